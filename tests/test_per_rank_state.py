"""SLAMB's per-rank state at every boundary: checkpoints, DCP, the loss scaler, late parameters, odd steps.

Two gloo workers, each training on its own data, as under a real launcher.
"""
from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import slamb
from tests import distributed

OPTIMIZERS = {  # small enough that every branch runs in a few steps: compression, syncs, the 1-bit stage
    "slamb": lambda ps, **kw: slamb.SLAMB(ps, **{"lr": 0.05, "compress_ratio": 0.25, "sync_interval": 2,
                                                 "min_compress_numel": 40, **kw}),
    "dgc": lambda ps, **kw: slamb.DGC(ps, **{"lr": 0.1, "density": 0.3, "warmup_densities": (), **kw}),
    "onebit": lambda ps, **kw: slamb.OnebitLamb(ps, **{"lr": 0.01, "freeze_step": 2, **kw}),
}
STEPS, CUT = 6, 3


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)
        self.late = torch.nn.Linear(6, 16)  # used only when asked: a parameter whose first gradient comes late

    def forward(self, x, late: bool = False):
        h = self.fc1(x) + (self.late(x) if late else 0)
        return self.fc2(torch.tanh(h))


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def build(name: str, wrap: bool = True, **kw):
    """Model, what the loop calls (DDP where ``wrap``), optimizer; the same initial model on every rank."""
    torch.manual_seed(0)
    model = Net()
    if wrap:  # DDP's reducer wants a gradient for every trainable parameter at every step
        model.late.requires_grad_(False)
    opt = OPTIMIZERS[name]([p for p in model.parameters() if p.requires_grad], **kw)
    return model, (slamb.wrap_model(model, opt) if wrap else model), opt


def train(ddp, opt, rank: int, steps, late=lambda step: False):
    for step in steps:
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x, late(step)), y).backward()
        opt.step()


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def through_bytes(obj):
    """What a file would give back: no tensor shared with the live optimizer."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# ------------------------------------------------------------------------------ the workers


def resume_case(rank, name, directory):
    model, ddp, opt = build(name)
    train(ddp, opt, rank, range(STEPS))
    whole = {"params": snapshot(model), "ledger": opt.comm_stats()["total"]}

    model, ddp, opt = build(name)
    train(ddp, opt, rank, range(CUT))
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    path = slamb.save_optimizer(opt, directory)
    model, ddp, opt = build(name)  # a fresh process would start here
    model.load_state_dict(saved_model)
    slamb.load_optimizer(opt, directory)
    train(ddp, opt, rank, range(CUT, STEPS))
    return {"whole": whole, "resumed": {"params": snapshot(model), "ledger": opt.comm_stats()["total"]},
            "file": path.name}


def dcp_case(rank, name):
    model, ddp, opt = build(name)
    train(ddp, opt, rank, range(CUT))
    saved = through_bytes({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)})
    train(ddp, opt, rank, range(CUT, STEPS))
    whole = snapshot(model)

    model, ddp, opt = build(name)
    fresh = get_optimizer_state_dict(model, opt)  # takes no step, sends nothing
    untouched = (opt._step, opt.ledger.steps, opt.ledger.summary()["total"]["all"]["payload"]) == (0, 0, 0)
    model.load_state_dict(saved["model"])  # the rank's own parameters first, as set_state_dict does
    set_optimizer_state_dict(model, opt, saved["optim"])
    train(ddp, opt, rank, range(CUT, STEPS))
    return {"equal": all(torch.equal(a, b) for a, b in zip(whole, snapshot(model))), "keys": sorted(saved["optim"]),
            "untouched": untouched and fresh["param_groups"][0][opt.state_key]["step"] == 0}


def dcp_disk_case(rank, directory):
    """DCP's own files keep one copy of each entry for all ranks: a per-rank state must be refused on load."""
    import torch.distributed.checkpoint as dcp

    model, ddp, opt = build("slamb")
    train(ddp, opt, rank, range(CUT))
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=directory)
    model, ddp, opt = build("slamb")
    loaded = {"optim": get_optimizer_state_dict(model, opt)}
    dcp.load(loaded, checkpoint_id=directory)
    try:
        set_optimizer_state_dict(model, opt, loaded["optim"])
    except ValueError as e:
        return str(e)
    return None


def scaler_case(rank):
    model, ddp, opt = build("slamb")
    scaler = slamb.RankAgreedGradScaler("cpu", init_scale=1024.0, growth_interval=2)
    out = []
    for step in range(4):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(F.mse_loss(ddp(x), y)).backward()
        if step == 1 and rank == 1:
            model.fc1.weight.grad[0, 0] = math.inf  # only this rank overflows
        before = snapshot(model)
        if step == 2:  # the unscale_ / clip / step path
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        out.append({"moved": any(not torch.equal(a, b) for a, b in zip(before, snapshot(model))),
                    "scale": scaler.get_scale(), "ledger_steps": opt.ledger.steps, "opt_steps": opt._step,
                    "sent": {k: v.payload for k, v in opt.ledger.last_step.items()}})
    return {"steps": out, "state": scaler.state_dict()}


def late_case(rank, name, late_step, both):
    """A parameter that gets its first gradient at ``late_step``, on rank 1 only unless ``both``."""
    model, ddp, opt = build(name, wrap=False)
    before = model.late.weight.detach().clone()
    try:
        train(ddp, opt, rank, range(5), late=lambda step: step == late_step and (both or rank == 1))
    except ValueError as e:
        return {"error": str(e)}
    ids = opt._layout_ids
    return {"moved": not torch.equal(before, model.late.weight), "weight": model.late.weight.detach().clone(),
            "layout": list(ids), "steps": opt._step}


def lr_zero_case(rank, name):
    model, ddp, opt = build(name, lr=0.0)
    before = snapshot(model)
    train(ddp, opt, rank, range(2))
    still = all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))
    for g in opt.param_groups:
        g["lr"] = 0.01  # a warm-up schedule's second value
    train(ddp, opt, rank, range(2, 3))
    return {"still": still, "moved": any(not torch.equal(a, b) for a, b in zip(before, snapshot(model)))}


def empty_case(rank, name):
    model, ddp, opt = build(name)
    before = snapshot(model)
    out = {"first": opt.step()}  # before any gradient: the layout is not fixed yet
    out.update(layout=opt._layout_ids, steps=opt._step, ledger=opt.ledger.steps,
               sent={k: v.payload for k, v in opt.ledger.last_step.items()},
               still=all(torch.equal(a, b) for a, b in zip(before, snapshot(model))))
    train(ddp, opt, rank, range(1))
    opt.zero_grad(set_to_none=True)
    opt.step()  # no gradient anywhere again
    out["after_empty"] = opt._step
    opt.zero_grad(set_to_none=True)
    if rank == 1:  # one rank has gradients: everyone steps (the other's count as zero)
        x, y = batch(rank, 1)
        F.mse_loss(model(x), y).backward()
    opt.step()
    out["after_one_sided"] = opt._step
    return out


def compile_case(rank, name):
    model_a, ddp_a, eager = build(name)
    model_b, ddp_b, opt_b = build(name)
    compiled = torch.compile(opt_b.step)
    for step in range(3):
        for ddp, opt in ((ddp_a, eager), (ddp_b, opt_b)):
            x, y = batch(rank, step)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(ddp(x), y).backward()
        eager.step()
        compiled()
    return all(torch.equal(a, b) for a, b in zip(snapshot(model_a), snapshot(model_b)))


def plain_ddp_case(rank, **kw):
    """SLAMB under torch's own DDP, which all-reduces every gradient before the step: the first step's refusal, what
    it changed and sent; then the same with ``allow_same_gradients`` (the steps taken)."""
    model, _, opt = build("slamb", wrap=False, **kw)
    model.late.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    before = snapshot(model)
    try:
        train(ddp, opt, rank, range(1))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    out = {"refused": refused, "untouched": all(torch.equal(a, b) for a, b in zip(before, snapshot(model))),
           "sent": {k: v["payload"] for k, v in opt.comm_stats()["total"].items()}}
    model, _, opt = build("slamb", wrap=False, **kw)
    model.late.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt.allow_same_gradients = True
    train(ddp, opt, rank, range(3))
    out["allowed steps"] = opt._step
    return out


def worker(rank, world, directory):
    return {
        "resume": {name: resume_case(rank, name, f"{directory}/{name}") for name in OPTIMIZERS},
        "dcp": {name: dcp_case(rank, name) for name in OPTIMIZERS},
        "dcp_disk": dcp_disk_case(rank, f"{directory}/dcp"),
        "scaler": scaler_case(rank),
        "late": {f"{name}-{step}-{both}": late_case(rank, name, step, both)
                 for name, step, both in (("slamb", 2, False), ("dgc", 2, False), ("onebit", 1, True),
                                          ("onebit", 3, True))},
        "lr0": {name: lr_zero_case(rank, name) for name in OPTIMIZERS},
        "empty": {name: empty_case(rank, name) for name in ("slamb", "dgc")},
        "compile": {name: compile_case(rank, name) for name in OPTIMIZERS},
        "plain_ddp": {"multi-tensor": plain_ddp_case(rank), "fused": plain_ddp_case(rank, fused=True)},
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed.run(worker, 2, str(tmp_path_factory.mktemp("per_rank")))


# ------------------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.multiprocess
def test_resume_from_per_rank_files_ends_bit_exactly_where_the_uninterrupted_run_ends(results, name):
    ranks = [r["resume"][name] for r in results]
    for rank, r in enumerate(ranks):
        assert r["file"] == f"optimizer.rank{rank}-of-2.pt"
        assert all(torch.equal(a, b) for a, b in zip(r["whole"]["params"], r["resumed"]["params"]))
        # the same traffic, but for the layout check the resumed run makes when it loads
        assert ({k: v for k, v in r["resumed"]["ledger"].items() if k not in ("control", "all")}
                == {k: v for k, v in r["whole"]["ledger"].items() if k not in ("control", "all")})
    if name == "slamb":  # the runs really are per rank: the ranks' parameters differ after an unsynced step
        assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["whole"]["params"], ranks[1]["whole"]["params"]))


def test_checkpoint_errors_name_the_file_and_the_fix(tmp_path):
    model = Net()
    opt = OPTIMIZERS["slamb"](model.parameters())
    model(torch.randn(2, 6), late=True).sum().backward()
    opt.step()
    with pytest.raises(FileNotFoundError, match=r"optimizer.rank0-of-1.pt is missing: no optimizer state for rank "
                                                r"0 of 1 .* save it with slamb.save_optimizer"):
        slamb.load_optimizer(opt, tmp_path / "empty")

    two = tmp_path / "two"  # what a 2-rank run leaves
    two.mkdir()
    (two / "optimizer.rank0-of-2.pt").write_bytes(b"")
    (two / "optimizer.rank1-of-2.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"world of size 2, this run has 1 ranks.* resume with 2 ranks"):
        slamb.load_optimizer(opt, two)

    path = slamb.save_optimizer(opt, tmp_path / "mine")
    assert path.name == "optimizer.rank0-of-1.pt" and slamb.load_optimizer(opt, tmp_path / "mine") == path
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"optimizer.rank0-of-1.pt: unreadable optimizer state .* truncated or "
                                         r"corrupt; save it again"):
        slamb.load_optimizer(opt, tmp_path / "mine")

    adamw = torch.optim.AdamW(model.parameters())
    assert slamb.save_optimizer(adamw, tmp_path / "shared").name == "optimizer.pt"
    with pytest.raises(FileNotFoundError, match=r"holds one shared optimizer state \(optimizer.pt\)"):
        slamb.load_optimizer(opt, tmp_path / "shared")
    with pytest.raises(FileNotFoundError, match=r"optimizer.pt is missing: .* per-rank optimizer states"):
        slamb.load_optimizer(adamw, two)

    dgc = OPTIMIZERS["dgc"](model.parameters())
    slamb.save_optimizer(dgc, tmp_path / "dgc")
    with pytest.raises(ValueError, match=r"holds the state of DGC, this optimizer is SLAMB: construct a DGC"):
        slamb.load_optimizer(opt, tmp_path / "dgc")

    slamb.save_optimizer(opt, tmp_path / "layout")
    other = OPTIMIZERS["slamb"](torch.nn.Linear(6, 5).parameters())
    with pytest.raises(ValueError, match=r"optimizer.rank0-of-1.pt: SLAMB checkpoint was saved for a different "
                                         r"parameter layout"):
        slamb.load_optimizer(other, tmp_path / "layout")

    path = slamb.save_optimizer(opt, tmp_path / "renamed")
    torch.save({**torch.load(path, weights_only=True), "rank": 1}, path)  # as if copied from another rank
    with pytest.raises(ValueError, match=r"holds the state of rank 1 of 1, read by rank 0 of 1: the file was "
                                         r"renamed or copied"):
        slamb.load_optimizer(opt, tmp_path / "renamed")


@pytest.mark.multiprocess
def test_dcp_state_dict_round_trip_continues_bit_exactly(results):
    for name in OPTIMIZERS:
        for r in results:
            assert r["dcp"][name]["equal"], name
            assert r["dcp"][name]["keys"] == ["param_groups", "state"]  # all DCP keeps, and all it needs
            assert r["dcp"][name]["untouched"], name


@pytest.mark.multiprocess
def test_dcp_files_of_per_rank_state_are_refused_on_every_rank_with_the_fix(results):
    for r in results:  # which rank's copy DCP kept varies: each rank gets one of the two refusals
        assert r["dcp_disk"] is not None and "slamb.save_optimizer and slamb.load_optimizer" in r["dcp_disk"]
        assert ("lost on the way" in r["dcp_disk"]) or ("cannot be redistributed" in r["dcp_disk"])


# ------------------------------------------------------------------------------ the loss scaler


@pytest.mark.multiprocess
def test_overflow_on_one_rank_is_skipped_by_every_rank_and_closes_the_ledger_step(results):
    a, b = (r["scaler"] for r in results)
    assert a == b  # the same decisions, scales and bytes on both ranks
    steps = a["steps"]
    assert [s["moved"] for s in steps] == [True, False, True, True]
    assert [s["scale"] for s in steps] == [1024.0, 512.0, 512.0, 1024.0]  # backed off, grown after 2 clean steps
    assert [s["ledger_steps"] for s in steps] == [1, 2, 3, 4]  # the skipped step is closed too
    assert [s["opt_steps"] for s in steps] == [1, 1, 2, 3]
    assert steps[1]["sent"] == {"control": 4}  # the agreed flag, and nothing of SLAMB's
    assert steps[2]["sent"]["control"] == 4 + 4 and steps[2]["sent"]["momentum"] > 0  # scaler's + step's flags
    assert a["state"]["skipped_steps"] == 1 and a["state"]["scale"] == 1024.0


@pytest.mark.multiprocess
def test_scaler_is_torch_gradscaler_with_one_rank():
    def run(scaler):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x, y = batch(0, step)
            opt.zero_grad()
            scaler.scale(F.mse_loss(model(x), y) * (1e30 if step == 1 else 1)).backward()
            scaler.step(opt)
            scaler.update()
        return snapshot(model), scaler.get_scale()

    ours = run(slamb.RankAgreedGradScaler("cpu", init_scale=2.0**120))
    theirs = run(torch.amp.GradScaler("cpu", init_scale=2.0**120))
    assert ours[1] == theirs[1] == 2.0**119
    assert all(torch.equal(a, b) for a, b in zip(ours[0], theirs[0]))


# ------------------------------------------------------------------------------ late gradients, odd steps


@pytest.mark.multiprocess
def test_a_parameter_with_a_late_gradient_joins_the_layout_on_every_rank(results):
    for name in ("slamb", "dgc"):
        a, b = (r["late"][f"{name}-2-False"] for r in results)
        assert a["layout"] == b["layout"] and len(a["layout"]) == 6  # fc1, fc2 and late: weights and biases
        assert a["moved"] and b["moved"]  # rank 0 never had its gradient: the averaged momentum moves it
        assert torch.equal(a["weight"], b["weight"])  # a sync (SLAMB) or the shared update (DGC) since
        assert a["steps"] == b["steps"] == 5
    warm = results[0]["late"]["onebit-1-True"]
    assert warm["moved"] and len(warm["layout"]) == 6
    for r in results:  # after freeze_step: refused on every rank, with the parameter named
        assert r["late"]["onebit-3-True"]["error"].startswith(
            "OnebitLamb: param[4] (16, 6), param[5] (16,) got a gradient for the first time after freeze_step=2")


@pytest.mark.multiprocess
def test_lr_zero_is_accepted_and_leaves_the_parameters_alone(results):
    for name in OPTIMIZERS:
        for r in results:
            assert r["lr0"][name] == {"still": True, "moved": True}, name
    for cls in (slamb.SLAMB, slamb.DGC, slamb.OnebitLamb, slamb.LAMB):
        cls(Net().parameters(), lr=0.0)


@pytest.mark.multiprocess
def test_a_step_without_gradients_on_any_rank_does_nothing(results):
    for name in ("slamb", "dgc"):
        for r in results:
            e = r["empty"][name]
            assert e["first"] is None and e["layout"] is None and e["steps"] == 0 and e["still"]
            assert e["ledger"] == 1 and e["sent"] == {"control": 4}  # the agreed decision only
            assert e["after_empty"] == 1 and e["after_one_sided"] == 2


@pytest.mark.multiprocess
def test_compiled_step_equals_the_eager_step(results):
    for r in results:
        assert r["compile"] == {name: True for name in OPTIMIZERS}


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["multi-tensor", "fused"])
def test_plain_ddp_is_refused_at_the_first_step_in_one_line_unless_allowed(results, path):
    """Before: a warning after 3 steps, which went on all-reducing every gradient beside the exchange."""
    for r in results:
        got = r["plain_ddp"][path]
        assert got["refused"] is not None and "\n" not in got["refused"], got["refused"]
        assert got["refused"].startswith("SLAMB: every rank holds the same gradients at the first step: they were "
                                         "averaged across the ranks before it (torch's DistributedDataParallel")
        assert "model = slamb.wrap_model(model, optimizer)" in got["refused"]
        assert "optimizer.allow_same_gradients = True" in got["refused"]
        # before it changed anything or sent a byte of its own: the layout check's gather only
        assert got["untouched"] and set(got["sent"]) <= {"control", "all"}
        assert got["allowed steps"] == 3  # opted in: it trains
