"""The ledger records exactly what each collective is handed, and the collectives compute the right thing."""
import pytest
import torch

from slamb import comm
from tests import distributed


def test_wire_factors_of_ring_algorithms():
    assert comm.wire_factor("all_reduce", 4) == 1.5
    assert comm.wire_factor("all_gather", 4) == 3.0
    assert comm.wire_factor("all_to_all", 4) == 0.75
    assert comm.wire_factor("reduce_scatter", 8) == 7 / 8
    assert comm.wire_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        comm.wire_factor("scatter", 2)


def test_ledger_steps_totals_and_state_dict():
    ledger = comm.CommLedger()
    ledger.record("momentum", "all_reduce", 400, 4)
    ledger.record("momentum", "all_reduce", 100, 4)
    ledger.record("params", "all_reduce", 1000, 4)
    ledger.end_step()
    ledger.record("momentum", "all_reduce", 40, 4)
    summary = ledger.summary()
    assert summary["last_step"]["momentum"] == {"payload": 500, "wire": 750.0, "calls": 2}
    assert summary["last_step"]["all"]["payload"] == 1500
    assert summary["total"]["momentum"]["payload"] == 540  # open step counted in the total
    ledger.end_step()
    copy = comm.CommLedger()
    copy.load_state_dict(ledger.state_dict())
    assert copy.summary()["total"] == ledger.summary()["total"] and copy.steps == 2
    ledger.record("x", "all_reduce", 10, 1)  # one rank: nothing is sent, nothing recorded
    assert "x" not in ledger.summary()["total"]


def collectives_worker(rank, world):
    ledger = comm.CommLedger()
    out = {}
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    out["mean"] = comm.all_reduce_mean_(x.clone(), kind="a", ledger=ledger)
    h = torch.full((6,), 40000.0).half()  # the sum over ranks would overflow fp16
    out["mean16"] = comm.all_reduce_mean_(h, kind="b", ledger=ledger)
    gathered = torch.empty(world * 3, dtype=torch.int64)
    out["gather"] = comm.all_gather_into_tensor(gathered, torch.full((3,), rank), kind="c", ledger=ledger)
    a2a = torch.empty(world * 2, dtype=torch.uint8)
    src = torch.arange(world * 2, dtype=torch.uint8) + 100 * rank
    out["a2a"] = comm.all_to_all_single(a2a, src, kind="d", ledger=ledger)
    out["bcast"] = comm.broadcast_(torch.full((5,), float(rank)), src=1, kind="e", ledger=ledger)
    out["any_false"] = comm.agree_any(torch.tensor(False), ledger=ledger)
    out["any_true"] = comm.agree_any(torch.tensor(rank == world - 1), ledger=ledger)
    ledger.end_step()
    out["stats"] = ledger.summary()["last_step"]
    return out


def test_collectives_and_their_bytes_on_three_ranks():
    n = 3
    res = distributed.run(collectives_worker, n)
    for r, out in enumerate(res):
        torch.testing.assert_close(out["mean"], torch.arange(6, dtype=torch.float32) + 10.0)
        torch.testing.assert_close(out["mean16"].float(), torch.full((6,), 40000.0), rtol=1e-3, atol=0)
        assert out["gather"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert out["a2a"].tolist() == [2 * r + 100 * j + i for j in range(n) for i in range(2)]
        assert out["bcast"].tolist() == [1.0] * 5
        assert out["any_false"] is False and out["any_true"] is True
        s = out["stats"]
        assert s["a"] == {"payload": 24, "wire": 24 * 4 / 3, "calls": 1}
        assert s["b"]["payload"] == 12
        assert s["c"] == {"payload": 24, "wire": 48.0, "calls": 1}
        assert s["d"] == {"payload": 6, "wire": 4.0, "calls": 1}
        assert s["e"]["payload"] == 20
        assert s["control"] == {"payload": 8, "wire": 8 * 4 / 3, "calls": 2}
