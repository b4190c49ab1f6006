"""What a new user of SLAMB and LAMB on FSDP2/HSDP gets wrong, on 4 gloo processes (HSDP 2 x 2): each is refused in
one line naming the fix, before it changes anything, or gives the right result.

* ``slamb.load_sharded`` before ``slamb.wrap_model`` (whose broadcast of replica 0's shards would overwrite the
  other replica's loaded ones);
* an optimizer built before ``slamb.shard_model`` (on the parameters ``fully_shard`` replaces), with and without
  ``wrap_model``;
* a sharded model trained without ``wrap_model``: the replicas keep the weights each built, and FSDP's own
  collectives (its HSDP gradient all-reduce included) stay out of the optimizer's ledger;
* ranks that start a plain (unsharded) SLAMB run from different weights, ``wrap_model`` forgotten.
"""
from __future__ import annotations

import pytest
import torch

import slamb
from tests import distributed
from tests.test_fsdp import hsdp_mesh, make_model, slamb_settings
from tests.test_fsdp_checkpoint import BLOCKS, shards, train

pytestmark = pytest.mark.multiprocess

SAVED_AT, STEPS = 2, 4  # sync_interval 2: the replicas differ at the save (after step 2)


def build_optimizer(kind, params):
    if kind == "slamb":
        return slamb.SLAMB(params, **slamb_settings({}))
    return slamb.LAMB(params, lr=0.02, weight_decay=0.01)


def attempt(call) -> str | None:
    """The one line ``call()`` is refused with, or None."""
    try:
        call()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def differently_seeded(rank):
    """The model built from another seed on every rank (each rank's own initialization)."""
    model = make_model()
    with torch.no_grad():
        g = torch.Generator().manual_seed(rank)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def load_before_wrap(rank, root):
    """A SLAMB run saved where the replicas differ, resumed by fresh objects that load before they wrap."""
    model = slamb.shard_model(make_model(), hsdp_mesh(), blocks=BLOCKS)
    opt = build_optimizer("slamb", model.parameters())
    model = slamb.wrap_model(model, opt)
    train(model, opt, rank, range(1, SAVED_AT + 1))
    slamb.save_sharded(model, opt, root)
    train(model, opt, rank, range(SAVED_AT + 1, STEPS + 1))
    fresh = slamb.shard_model(make_model(), hsdp_mesh(), blocks=BLOCKS)
    fresh_opt = build_optimizer("slamb", fresh.parameters())
    before = shards(fresh)
    refused = attempt(lambda: slamb.load_sharded(fresh, fresh_opt, root))
    untouched = all(torch.equal(a, b) for a, b in zip(before, shards(fresh)))
    if refused is None:  # the order was taken: what it resumes to
        fresh = slamb.wrap_model(fresh, fresh_opt)
        train(fresh, fresh_opt, rank, range(SAVED_AT + 1, STEPS + 1))
    return {"refused": refused, "untouched": untouched, "uninterrupted": shards(model), "resumed": shards(fresh)}


def built_before_shard_model(rank, kind):
    """The optimizer built on the model's parameters, then the model sharded: with wrap_model, and without it."""
    out = {}
    model = make_model()
    opt = build_optimizer(kind, model.parameters())
    model = slamb.shard_model(model, hsdp_mesh(), blocks=BLOCKS)
    out["wrap_model"] = attempt(lambda: slamb.wrap_model(model, opt))
    model = make_model()
    opt = build_optimizer(kind, model.parameters())
    model = slamb.shard_model(model, hsdp_mesh(), blocks=BLOCKS)
    before = shards(model)
    out["no wrap_model"] = attempt(lambda: train(model, opt, rank, range(1, 3)))
    out["trained"] = not all(torch.equal(a, b) for a, b in zip(before, shards(model)))
    return out


def without_wrap_model(rank, kind, seeded):
    """A sharded model (from each rank's own weights where ``seeded``), its optimizer built on its shards, trained
    without wrap_model: the refusal, and whether the step changed anything or sent a byte."""
    model = slamb.shard_model(differently_seeded(rank) if seeded else make_model(), hsdp_mesh(), blocks=BLOCKS)
    opt = build_optimizer(kind, model.parameters())
    before = shards(model)
    refused = attempt(lambda: train(model, opt, rank, range(1, 3)))
    return {"refused": refused, "untouched": all(torch.equal(a, b) for a, b in zip(before, shards(model))),
            "ledger": opt.comm_stats()["total"]}


def plain_ranks_differ(rank):
    """Unsharded SLAMB from each rank's own weights: without wrap_model (refused), and with it (every rank starts
    from rank 0's)."""
    model = differently_seeded(rank)
    opt = build_optimizer("slamb", model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    refused = attempt(lambda: train(model, opt, rank, range(1, 3)))
    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model = differently_seeded(rank)
    opt = build_optimizer("slamb", model.parameters())
    wrapped = slamb.wrap_model(model, opt)
    start = [p.detach().clone() for p in model.parameters()]
    train(wrapped, opt, rank, range(1, 3))
    return {"refused": refused, "untouched": untouched, "wrapped start": start, "wrapped steps": opt._step}


def worker(rank, world, root):
    out = {"load before wrap": load_before_wrap(rank, root / "slamb")}
    for kind in ("slamb", "lamb"):
        out[kind, "built before"] = built_before_shard_model(rank, kind)
        out[kind, "no wrap"] = without_wrap_model(rank, kind, seeded=False)
        out[kind, "no wrap, ranks differ"] = without_wrap_model(rank, kind, seeded=True)
    out["plain, ranks differ"] = plain_ranks_differ(rank)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return distributed.run(worker, 4, tmp_path_factory.mktemp("misuse"))


def one_line(message, *fixes):
    assert message is not None, "accepted"
    print(message)
    assert "\n" not in message and all(fix in message for fix in fixes), message


def test_load_sharded_before_wrap_model_is_refused_before_it_loads(runs):
    for r in runs:
        got = r["load before wrap"]
        # accepted, replica 1 resumed from replica 0's shards: the run drifted from the uninterrupted one
        one_line(got["refused"], "slamb.wrap_model(model, optimizer)", "then slamb.load_sharded")
        assert got["untouched"]


@pytest.mark.parametrize("kind", ["slamb", "lamb"])
def test_an_optimizer_built_before_shard_model_is_refused_with_and_without_wrap_model(runs, kind):
    for r in runs:
        got = r[kind, "built before"]
        for case in ("wrap_model", "no wrap_model"):
            one_line(got[case], "build the optimizer after slamb.shard_model", "model.parameters()")
            assert "takes no sharded" not in got[case]
        assert not got["trained"]


@pytest.mark.parametrize("kind", ["slamb", "lamb"])
@pytest.mark.parametrize("seeded", [False, True], ids=["same weights", "ranks differ"])
def test_a_sharded_step_without_wrap_model_is_refused_before_it_sends_anything(runs, kind, seeded):
    """Without wrap_model the replicas keep the weights each rank built (``ranks differ``), and FSDP's all-gathers,
    reduce-scatters and HSDP gradient all-reduce are missing from the ledger."""
    for r in runs:
        got = r[kind, "no wrap, ranks differ" if seeded else "no wrap"]
        one_line(got["refused"], "slamb.wrap_model(model, optimizer)", "before the first step")
        assert got["untouched"] and got["ledger"]["all"]["payload"] == 0


def test_a_plain_run_whose_ranks_start_from_different_weights_is_refused(runs):
    for r in runs:
        got = r["plain, ranks differ"]
        one_line(got["refused"], "slamb.wrap_model(model, optimizer)", "different parameters")
        assert got["untouched"]
    # with wrap_model every rank starts from rank 0's weights, and trains
    start = runs[0]["plain, ranks differ"]["wrapped start"]
    assert all(torch.equal(a, b) for r in runs[1:] for a, b in zip(r["plain, ranks differ"]["wrapped start"], start))
    assert all(r["plain, ranks differ"]["wrapped steps"] == 2 for r in runs)
