"""The ledger records exactly what each collective is handed, and the collectives compute the right thing."""
import math
import os
import subprocess
import sys
from pathlib import Path

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
    ledger.record("heal", "all_reduce", 10, 1)  # one rank: nothing is sent, nothing recorded
    assert "heal" not in ledger.summary()["total"]


def test_the_ledger_refuses_a_kind_it_does_not_keep():
    ledger = comm.CommLedger()
    for n in (1, 4):  # a misspelt kind is caught on one rank too
        with pytest.raises(ValueError, match=r"unknown ledger kind 'momentum_sampled': must be one of \['grads'"):
            ledger.record("momentum_sampled", "all_reduce", 10, n)
    assert ledger.summary()["total"] == {"all": {"payload": 0, "wire": 0, "calls": 0}}


def test_ledger_keeps_each_level_apart_and_in_its_totals():
    ledger = comm.CommLedger()
    ledger.record("momentum", "all_reduce", 100, 2, level="inter")
    comm.at_level(ledger, "intra").record("momentum", "all_gather", 100, 4)
    ledger.record("momentum", "all_reduce", 10, 2)  # no level: in the kind's totals only
    ledger.end_step()
    step = ledger.summary()["last_step"]
    assert step["momentum"]["payload"] == 210 and step["momentum"]["wire"] == 100 + 300 + 10
    assert step["momentum"]["levels"] == {"inter": {"payload": 100, "wire": 100.0, "calls": 1},
                                          "intra": {"payload": 100, "wire": 300.0, "calls": 1}}
    assert step["all"]["levels"]["intra"]["wire"] == 300.0
    ledger.record("momentum", "all_reduce", 100, 2, level="inter")
    assert ledger.summary()["total"]["momentum"]["levels"]["inter"]["payload"] == 200  # the open step counts
    ledger.end_step()
    copy = comm.CommLedger()
    copy.load_state_dict(ledger.state_dict())
    assert copy.summary()["total"] == ledger.summary()["total"]


def collectives_worker(rank, world):
    ledger = comm.CommLedger()
    out = {}
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    out["mean"] = comm.all_reduce_mean_(x.clone(), kind="grads", ledger=ledger)
    h = torch.full((6,), 40000.0).half()  # the sum over ranks would overflow fp16
    out["mean16"] = comm.all_reduce_mean_(h, kind="momentum", ledger=ledger)
    gathered = torch.empty(world * 3, dtype=torch.int64)
    out["gather"] = comm.all_gather_into_tensor(gathered, torch.full((3,), rank), kind="params", ledger=ledger)
    a2a = torch.empty(world * 2, dtype=torch.uint8)
    src = torch.arange(world * 2, dtype=torch.uint8) + 100 * rank
    out["a2a"] = comm.all_to_all_single(a2a, src, kind="residual", ledger=ledger)
    out["bcast"] = comm.broadcast_(torch.full((5,), float(rank)), src=1, kind="heal", ledger=ledger)
    out["any_false"] = comm.agree_any(torch.tensor(False), ledger=ledger)
    out["any_true"] = comm.agree_any(torch.tensor(rank == world - 1), ledger=ledger)
    ledger.end_step()
    out["stats"] = ledger.summary()["last_step"]
    return out


@pytest.mark.multiprocess
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
        assert s["grads"] == {"payload": 24, "wire": 24 * 4 / 3, "calls": 1}
        assert s["momentum"]["payload"] == 12
        assert s["params"] == {"payload": 24, "wire": 48.0, "calls": 1}
        assert s["residual"] == {"payload": 6, "wire": 4.0, "calls": 1}
        assert s["heal"]["payload"] == 20
        assert s["control"] == {"payload": 8, "wire": 8 * 4 / 3, "calls": 2}


def ring_sum_fp16(terms):
    """What a ring all-reduce does to one entry in fp16: n - 1 additions, each rounded to fp16."""
    acc = terms[0].clone()
    for t in terms[1:]:
        acc = (acc.float() + t.float()).half()
    return acc


def test_fp16_exchange_stays_at_fp16_rounding_at_1024_ranks():
    """Momentum of RMS 1e-5 over n = 1,024 ranks: divided by n before the fp16 sum it falls into
    fp16's subnormals (most of the mean is lost); scaled by the agreed power of two its error is
    that of summing n fp16 numbers, the least any fp16 collective can have."""
    n, d = 1024, 2048
    gen = torch.Generator().manual_seed(0)
    xs = (torch.randn(d, generator=gen, dtype=torch.float64)
          + torch.randn(n, d, generator=gen, dtype=torch.float64)) * 1e-5
    exact = xs.mean(0)
    peak = xs.abs().max()

    def rel(a):
        return float((a.double() - exact).norm() / exact.norm())

    divided = ring_sum_fp16([(x / n).half() for x in xs])
    scale = comm.fp16_scale(peak, n).double()
    assert scale.item() == 2.0 ** math.floor(math.log2(65504 / n / peak.item()))
    scaled = ring_sum_fp16([(x * scale).half() for x in xs]).double() / scale / n
    floor = ring_sum_fp16([(x / peak).half() for x in xs]).double() * peak / n  # fp16's own rounding
    assert rel(divided) > 0.5
    assert rel(scaled) < 1e-2 and rel(scaled) < 1.1 * rel(floor)
    # no overflow: the largest possible sum of n scaled terms is finite in fp16
    assert torch.isfinite(torch.tensor(n * peak.item() * scale.item()).half())


def fp16_worker(rank, world):
    ledger = comm.CommLedger()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=gen) * 1e-6  # fp16's subnormals start at 6e-5
    mean = comm.all_reduce_mean_(x.clone(), kind="momentum", ledger=ledger, comm_dtype=torch.float16)
    pending = comm.all_reduce_mean_(x.clone(), kind="momentum", ledger=ledger, comm_dtype=torch.float16,
                                    async_op=True)
    exact = comm.all_reduce_mean_(x.double(), kind="momentum", ledger=None)
    ledger.end_step()
    return mean, pending.wait(), exact, ledger.summary()["last_step"]


@pytest.mark.multiprocess
def test_fp16_exchange_on_two_ranks_keeps_small_values():
    for mean, later, exact, stats in distributed.run(fp16_worker, 2):
        assert mean.dtype == torch.float32 and torch.equal(mean, later)
        assert float((mean.double() - exact).norm() / exact.norm()) < 2e-3
        assert stats["momentum"]["payload"] == 2 * 1000 * 2  # fp16 on the wire
        assert stats["control"] == {"payload": 8, "wire": 8.0, "calls": 2}  # the agreed scale, once per call


# A rank whose last act is a collective: the ranks' average, computed and then the process ends. The long switch
# interval keeps gloo's worker thread from taking the GIL before the main thread reaches the interpreter's
# finalization, which is where it aborted when that thread freed the collective's tensors.
EXIT_AFTER_A_COLLECTIVE = """
import sys
import torch
import torch.distributed as dist
import slamb
dist.init_process_group("gloo")
sys.setswitchinterval(1.0)
torch.manual_seed(dist.get_rank())
slamb.average_model(torch.nn.Linear(4, 4))
"""


@pytest.mark.multiprocess
def test_a_rank_that_ends_right_after_a_collective_exits_cleanly(tmp_path):
    """4 ranks under torchrun, 5 launches. Before the collectives kept their handles, 7 launches in 10 aborted
    ("terminate called without an active exception", exit -6), the Hugging Face example 2 runs in 19."""
    script = tmp_path / "average_then_exit.py"
    script.write_text(EXIT_AFTER_A_COLLECTIVE)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    for _ in range(5):
        done = subprocess.run([torchrun, "--nproc-per-node", "4", str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
