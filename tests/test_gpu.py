"""What ``make gpu-check`` verifies on a CUDA device, each check against the CPU (skipped without CUDA, as in CI).

The CPU results are the reference: every path there is tested against the reference functions and the
authors' code elsewhere, so a CUDA result that equals the CPU's to fp32 rounding is right too.
"""
from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch

import slamb
from tests import distributed
from tests.test_registry import SETTINGS

pytestmark = pytest.mark.gpu  # skipped without CUDA by tests/tiers.py

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
STEPS = 6
# fp32 rounding after a few steps: the trust ratios' norms are reductions whose order differs by device
RTOL, ATOL = 2e-5, 2e-6


def paths(name: str) -> list[str]:
    """The step implementations optimizer ``name`` offers: the per-tensor reference, multi-tensor, fused."""
    accepts = inspect.signature(slamb.registry.optimizer_class(name)).parameters
    out = ["default"]
    if "foreach" in accepts:
        out = ["reference", "foreach"]
    if "fused" in accepts:
        out.append("fused")
    return out


PATH_SETTINGS = {"default": {}, "reference": {"foreach": False}, "foreach": {"foreach": True},
                 "fused": {"fused": True}}


def small_model() -> torch.nn.Module:
    """Tensors above and below SLAMB's compression threshold (500 here), 1-D ones, a matrix whose
    coordinates some steps leave untouched (the embedding)."""
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(64, 24), "a": torch.nn.Linear(24, 96),
                                "b": torch.nn.Linear(96, 4), "c": torch.nn.Linear(4, 160)})


def forward(model, x):
    h = model["emb"](x).mean(1)
    return model["c"](torch.tanh(model["b"](torch.tanh(model["a"](h)))))


# the registry's optimizers with the settings that train under 2 workers, and SLAMB's other variant
ROWS = {**{name: (name, SETTINGS[name]) for name in SETTINGS}, "slamb_v1": ("slamb", {**SETTINGS["slamb"], "variant": "v1"})}


def train(row: str, path: str, device: torch.device) -> list[torch.Tensor]:
    """``STEPS`` steps of ``row`` on one device, world size 1; the inputs drawn on the CPU."""
    name, settings = ROWS[row]
    model = small_model().to(device)
    opt = slamb.create_optimizer(name, model, weight_decay=1e-3, **settings, **PATH_SETTINGS[path])
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        opt.begin_step()
        x = torch.randint(0, 32, (16, 5), generator=gen).to(device)  # rows 32-63 of the embedding stay cold
        y = torch.randn(16, 160, generator=gen).to(device)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(forward(model, x), y).backward()
        opt.step()
    assert_compiled(opt)
    return [p.detach().cpu() for p in model.parameters()]


def assert_compiled(opt) -> None:
    """A fused optimizer ran its compiled passes: none of its graphs failed to compile (it would have run the
    multi-tensor path, whose numbers are the same)."""
    assert getattr(opt, "fused_fallback", None) is None, opt.fused_fallback


CASES = [(row, path) for row in sorted(ROWS) for path in paths(ROWS[row][0])]


@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_optimizer_on_cuda_equals_cpu(name, path):
    """Every registry optimizer, every path it offers: CUDA's parameters are the CPU's to fp32 rounding."""
    torch.manual_seed(0)
    cpu = train(name, path, CPU)
    torch.manual_seed(0)
    cuda = train(name, path, CUDA)
    start = [p.detach() for p in small_model().parameters()]
    for a, b, s in zip(cpu, cuda, start):
        assert not torch.equal(a, s) or a.dim() == 0, name  # the step moved it
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def _freshness(bits, log2_b3):
    from slamb.optim.fused import age_of

    return torch.exp2(age_of(bits) * log2_b3)


def test_the_fp16_bit_age_on_cuda_reads_and_advances_every_counter():
    """SLAMB's int16 age reaches the fused graphs as fp16 bits: on CUDA, eager and in Triton kernels, every counter
    0..MAX_AGE reads as itself (age_of; SELECTED as NaN), the age pass makes it one more, held at MAX_AGE (0 where
    averaged), and r = b3^age is the CPU's to fp32 rounding."""
    from slamb.optim.fused import MAX_AGE, age_of, age_pass, compile_once
    from tests.test_fused import assert_every_age_read_and_advanced

    bits = torch.arange(MAX_AGE + 1, dtype=torch.int16, device=CUDA).view(torch.float16)
    log2_b3 = torch.full((MAX_AGE + 1,), math.log2(0.999), device=CUDA)
    want_r = _freshness(bits.cpu(), log2_b3.cpu())
    for read, advance, freshness in ((age_of, age_pass, _freshness),
                                     (compile_once(age_of), compile_once(age_pass), compile_once(_freshness))):
        assert_every_age_read_and_advanced(read, advance, CUDA)
        torch.testing.assert_close(freshness(bits, log2_b3).cpu(), want_r, rtol=2e-6, atol=0)


FUSED = {"lamb": {}, "slamb_v1": {"variant": "v1"}, "slamb_v2": {"variant": "v2"}}


def bert_like_params(device, layers: int = 2) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(3000, 64), (512, 64), (64,)] + [(256, 64), (256,), (64, 256), (64,), (64,), (64,)] * layers
    params = [torch.nn.Parameter((0.02 * torch.randn(s, generator=gen)).to(device)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    return params


def make(row: str, params, **kw):
    if row == "lamb":
        return slamb.LAMB(params, lr=1e-3, weight_decay=0.01, **kw)
    return slamb.SLAMB(params, lr=1e-3, weight_decay=0.01, min_compress_numel=1000, **FUSED[row], **kw)


def ulps_apart(a: torch.Tensor, b: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """|a - b|, two results of a step from ``before``, in units of the last place of their dtype at the largest
    magnitude of the three: where a step cancels most of a value, the fp32 rounding of the update is many units
    of the small result's last place."""
    info = torch.finfo(a.dtype)
    big = torch.stack([a.float().abs(), b.float().abs(), before.float().abs()]).amax(0).clamp_min(info.tiny)
    return (a.float() - b.float()).abs() / (torch.exp2(torch.floor(torch.log2(big))) * info.eps)


LOW_PATHS = [(row, path) for row in sorted(FUSED) for path in ("reference", "foreach", "fused")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("row,path", LOW_PATHS, ids=[f"{r}-{p}" for r, p in LOW_PATHS])
def test_low_precision_parameters_on_every_path_keep_fp32_state(row, path, dtype):
    """bf16 and fp16 parameters on CUDA, 3 steps of every path of LAMB and SLAMB v1/v2, each against the CPU's
    reference path stepped from the same parameters and state: the state is fp32 and its moments the CPU's to
    fp32 rounding, the parameters stay in their dtype within one unit in its last place of the CPU's
    (:func:`ulps_apart`: a step is computed in fp32 and rounded once), and a fused path ran its compiled passes."""
    start = [p.detach().to(dtype) for p in bert_like_params(CPU)]
    params = [torch.nn.Parameter(p.to(CUDA, copy=True)) for p in start]
    cpu_params = [torch.nn.Parameter(p.clone()) for p in start]
    opt, cpu_opt = make(row, params, **PATH_SETTINGS[path]), make(row, cpu_params, **PATH_SETTINGS["reference"])
    gen = torch.Generator().manual_seed(2)
    for t in range(3):
        for p, q in zip(params, cpu_params):
            q.grad = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad = q.grad.to(CUDA)
        if t:  # the CPU steps from where CUDA is: each step is compared, not their accumulated rounding
            with torch.no_grad():
                for p, q in zip(params, cpu_params):
                    q.copy_(p.cpu())
                    for key, value in opt.state[p].items():
                        cpu_opt.state[q][key].copy_(value.cpu())
        before = [q.detach().clone() for q in cpu_params]
        opt.step()
        cpu_opt.step()
        for p, q, b in zip(params, cpu_params, before):
            assert p.dtype == dtype and p.device.type == CUDA.type
            for key in ("exp_avg", "exp_avg_sq"):
                got, want = opt.state[p][key], cpu_opt.state[q][key]
                assert got.dtype == torch.float32, key
                torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=1e-7)
            assert float(ulps_apart(p.detach().cpu(), q.detach(), b).max()) <= 1.0, t
    assert_compiled(opt)
    assert not torch.equal(params[0].detach().cpu(), start[0])


@pytest.mark.parametrize("row", sorted(FUSED))
def test_fused_graphs_compile_without_graph_break(row):
    """``fused=True`` on CUDA: inductor's Triton kernels compile, with no graph break and no fallback."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    opt = make(row, bert_like_params(CUDA), fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.step()
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    assert_compiled(opt)
    assert dict(counters["graph_break"]) == {}
    assert sum(counters["stats"].get(k, 0) for k in ("unique_graphs",)) >= 1


# Host synchronisations per optimizer step, documented in docs/gpu.md ("Host synchronisations"):
# SLAMB: the rank-agreed step decision (the non-finite screen rides on it), the selection's per-tensor counts
# and the trust-ratio scalars (none on the fused path); LAMB: its non-finite screen only.
HOST_SYNCS = {("slamb_v1", "raise"): 3, ("slamb_v2", "raise"): 3, ("slamb_v1", "ignore"): 3,
              ("slamb_v2", "ignore"): 3, ("lamb", "raise"): 1, ("lamb", "ignore"): 0,
              ("slamb_v1_fused", "raise"): 2, ("slamb_v2_fused", "raise"): 2, ("lamb_fused", "raise"): 1}


@pytest.mark.parametrize("row,nonfinite", sorted(HOST_SYNCS))
def test_host_syncs_per_step(row, nonfinite):
    """torch.cuda.set_sync_debug_mode counts what a step makes the host wait for: the documented number."""
    fused = row.endswith("_fused")
    opt = make(row.removesuffix("_fused"), bert_like_params(CUDA), nonfinite=nonfinite, fused=fused)
    for _ in range(3):  # layout, state and the first-step parameter sync are built once
        opt.step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == HOST_SYNCS[(row, nonfinite)], syncs
    assert_compiled(opt)


def bert_phase1_losses(device, precision: str, name: str, steps: int = 4) -> list[float]:
    """Phase-1 steps of a small BERT (the pipeline's model, seq 128) through the harness's mixed precision."""
    from bert.model import build_model
    from harness.amp import MixedPrecision

    torch.manual_seed(0)
    cfg = dict(vocab_size=2000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
               intermediate_size=512, max_position_embeddings=512, type_vocab_size=2,
               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = build_model(cfg).to(device)
    settings = dict(lr=2e-3) if name == "lamb" else dict(lr=2e-3, compress_ratio=0.1, sync_interval=2)
    opt = slamb.create_optimizer(name, model, weight_decay=0.01, **settings)
    amp = MixedPrecision(precision, device, init_scale=2.0 ** 12, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 2000, (8, 128), generator=gen)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(ids.shape, generator=gen) < 0.15
    labels[masked] = ids[masked]
    batch = dict(input_ids=ids.to(device), labels=labels.to(device),
                 next_sentence_label=torch.randint(0, 2, (8,), generator=gen).to(device))
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with amp.autocast():
            loss = model(**batch).loss
        amp.backward(loss)
        skipped, _ = amp.step(opt, model.parameters())
        assert not skipped
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["lamb", "slamb"])
def test_bert_phase1_step_under_mixed_precision(name, precision):
    """fp16 (rank-agreed loss scale) and bf16 autocast on CUDA: no skipped step, the loss falls, and it
    follows the CPU's fp32 run to autocast's precision."""
    ref = bert_phase1_losses(CPU, "fp32", name)
    got = bert_phase1_losses(CUDA, precision, name)
    assert all(math.isfinite(x) for x in got)
    assert got[-1] < got[0] - 0.05
    tol = 0.005 if precision == "fp16" else 0.01  # bf16 keeps 8 bits of mantissa, fp16 11
    for a, b in zip(ref, got):
        assert abs(a - b) < tol * abs(a), (ref, got)


# what the library hands to NCCL: (collective, dtype) as slamb/comm.py, slamb/compression and DDP send them
NCCL_CALLS = [("all_reduce_sum", torch.float32), ("all_reduce_sum", torch.float16),
              ("all_reduce_sum", torch.bfloat16), ("all_reduce_sum", torch.float64), ("all_reduce_max", torch.float32),
              ("all_gather", torch.float32), ("all_gather", torch.int8), ("all_gather", torch.uint8),
              ("all_gather", torch.int64), ("all_to_all", torch.int8), ("all_to_all", torch.uint8),
              ("all_to_all", torch.float32), ("reduce_scatter", torch.float32), ("reduce_scatter", torch.bfloat16),
              ("broadcast", torch.float32), ("broadcast", torch.int64)]


def test_one_rank_nccl_group_takes_every_dtype_and_op():
    """A 1-rank NCCL group: every (collective, dtype) the library sends runs and returns its input, and SLAMB
    under ``wrap_model`` (DDP on NCCL) steps."""
    import torch.distributed as dist

    from slamb import comm

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        for op, dtype in NCCL_CALLS:
            x = (torch.arange(1000, device=CUDA) % 100).to(dtype)
            want = x.clone()
            if op == "all_reduce_sum":
                dist.all_reduce(x, op=dist.ReduceOp.SUM)
            elif op == "all_reduce_max":
                dist.all_reduce(x, op=dist.ReduceOp.MAX)
            elif op == "all_gather":
                out = torch.empty_like(x)
                comm._all_gather_single(out, x)
                x = out
            elif op == "reduce_scatter":
                out = torch.empty_like(x)
                comm._reduce_scatter_single(out, x)
                x = out
            elif op == "all_to_all":
                out = torch.empty_like(x)
                dist.all_to_all_single(out, x)
                x = out
            else:
                dist.broadcast(x, src=0)
            torch.cuda.synchronize()
            assert torch.equal(x, want), (op, dtype)
        model = Wrapped(small_model()).to(CUDA)
        opt = slamb.create_optimizer("slamb", model, **SETTINGS["slamb"])
        net = slamb.wrap_model(model, opt, device_ids=[0])
        x = torch.randint(0, 64, (8, 5), device=CUDA)
        for _ in range(3):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        dist.destroy_process_group()


def hsdp_run(kind: str, steps):
    """A float32 copy of tests/test_fsdp.py's model as one-rank HSDP on CUDA (a (1, 1) replicate x shard mesh),
    under fused SLAMB v2 or fused LAMB, wrapped, after ``steps``."""
    from torch.distributed.device_mesh import init_device_mesh

    from tests.test_fsdp import make_model

    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = slamb.shard_model(make_model().float().to(CUDA), mesh, blocks=(torch.nn.Linear, torch.nn.LayerNorm))
    if kind == "slamb":
        opt = slamb.SLAMB(model.parameters(), lr=0.02, weight_decay=0.01, compress_ratio=0.3, sync_interval=2,
                          min_compress_numel=64, variant="v2", fused=True)
    else:
        opt = slamb.LAMB(model.parameters(), lr=0.02, weight_decay=0.01, fused=True)
    model = slamb.wrap_model(model, opt)
    for t in steps:
        opt.zero_grad(set_to_none=True)
        hsdp_loss(model, t).backward()
        opt.step()
    return model, opt


def hsdp_loss(model, t):
    from tests.test_fsdp import batch

    x, y = batch(0, t)
    return torch.nn.functional.mse_loss(model(x.float().to(CUDA)), y.float().to(CUDA))


def local_state(model, opt) -> dict:
    return {f"{n}.{k}": (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for n, p in model.named_parameters() for k, v in opt.state[p].items()}


def test_one_rank_nccl_hsdp_checkpoint_resumes_bit_exactly(tmp_path):
    """A one-rank NCCL group, HSDP over a (1, 1) mesh with fused SLAMB v2 and fused LAMB: three steps,
    save_sharded, load_sharded into a fresh model and optimizer; the state loaded is the saved one bit for bit,
    and so is the next step's model."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        for kind in ("slamb", "lamb"):
            model, opt = hsdp_run(kind, range(1, 4))
            slamb.save_sharded(model, opt, tmp_path / kind)
            saved = local_state(model, opt)
            again, again_opt = hsdp_run(kind, [])
            slamb.load_sharded(again, again_opt, tmp_path / kind)
            loaded = local_state(again, again_opt)
            assert saved.keys() == loaded.keys() and len(saved) > 0
            assert all(torch.equal(saved[k], loaded[k]) for k in saved), kind
            for m, o in ((model, opt), (again, again_opt)):
                o.zero_grad(set_to_none=True)
                hsdp_loss(m, 4).backward()
                o.step()
                assert_compiled(o)
            for p, q in zip(model.parameters(), again.parameters()):
                assert torch.equal(p.to_local(), q.to_local()), kind
    finally:
        dist.destroy_process_group()


class Wrapped(torch.nn.Module):
    """The small model behind one forward, as DDP needs it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return forward(self.model, x)


def slamb_on_two_ranks(rank, device, steps=5, **settings) -> dict:
    """SLAMB under ``wrap_model`` on ``device``, each rank its own data; its parameters and warnings."""
    torch.manual_seed(0)
    model = Wrapped(small_model()).to(device)
    opt = slamb.SLAMB(model.parameters(), lr=0.01, weight_decay=0.01, compress_ratio=0.2, sync_interval=3,
                      min_compress_numel=500, **settings)
    net = slamb.wrap_model(model, opt, bucket_cap_mb=0.01)  # several buckets: several overlapped exchanges
    gen = torch.Generator().manual_seed(100 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            x = torch.randint(0, 64, (8, 5), generator=gen).to(device)
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    return {"params": [p.detach().cpu() for p in model.parameters()],
            "momentum": opt.comm_stats()["total"]["momentum"]["payload"],
            "warnings": [str(w.message) for w in caught], "fallback": opt.fused_fallback}


def gloo_cuda_worker(rank, world, comm_dtype):
    torch.cuda.set_device(0)
    return {d.type: slamb_on_two_ranks(rank, d, comm_dtype=comm_dtype) for d in (CPU, CUDA)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("comm_dtype", [None, torch.float16, torch.bfloat16, torch.int8],
                         ids=["fp32", "fp16", "bf16", "int8"])
def test_two_gloo_ranks_on_one_gpu_exchange_as_on_the_cpu(comm_dtype):
    """Two processes share the GPU over gloo (NCCL refuses two ranks on one device): SLAMB's exchange in
    each comm_dtype gives CUDA the CPU's parameters, with the same bytes."""
    for r in distributed.run(gloo_cuda_worker, 2, comm_dtype):
        assert r["cuda"]["momentum"] == r["cpu"]["momentum"] > 0
        # an entry one fp32 ulp apart before the cast can round to the neighbouring fp16, bf16 or int8 value
        tol = dict(rtol=RTOL, atol=ATOL) if comm_dtype is None else dict(rtol=1e-4, atol=1e-5)
        for a, b in zip(r["cpu"]["params"], r["cuda"]["params"]):
            torch.testing.assert_close(b, a, **tol)


def fused_exchange_worker(rank, world):
    torch.cuda.set_device(0)
    out = {}
    for comm_dtype in (None, torch.int8):
        for overlap in (False, True):
            runs = {d.type: slamb_on_two_ranks(rank, d, fused=True, comm_dtype=comm_dtype, overlap=overlap)
                    for d in (CPU, CUDA)}
            out[str(comm_dtype), overlap] = runs
    return out


@pytest.mark.multiprocess
def test_the_fused_exchange_on_two_gloo_ranks_on_one_gpu_equals_the_cpus():
    """Fused SLAMB's exchange by layout positions (the packed momentum gathered and scattered in a few ops), on two
    processes sharing the GPU over gloo, in fp32 and int8, plain and overlapped with backward (DDP's hook): CUDA's
    parameters are the CPU's, with the same bytes, and the compiled passes ran on both."""
    for r in distributed.run(fused_exchange_worker, 2):
        for (comm_dtype, overlap), runs in r.items():
            for run in runs.values():
                assert run["fallback"] is None and not [w for w in run["warnings"] if "gradients changed" in w]
            assert runs["cuda"]["momentum"] == runs["cpu"]["momentum"] > 0, (comm_dtype, overlap)
            # int8: an entry one fp32 ulp apart before the quantisation can take the neighbouring level
            tol = dict(rtol=RTOL, atol=ATOL) if comm_dtype == "None" else dict(rtol=1e-4, atol=1e-5)
            for a, b in zip(runs["cpu"]["params"], runs["cuda"]["params"]):
                torch.testing.assert_close(b, a, **tol)


def overlap_worker(rank, world):
    torch.cuda.set_device(0)
    return {overlap: slamb_on_two_ranks(rank, CUDA, overlap=overlap) for overlap in (False, True)}


@pytest.mark.multiprocess
def test_overlap_hook_on_cuda_equals_the_plain_exchange():
    """The exchange DDP's hook starts during backward (CUDA tensors, gloo) is the plain path's."""
    for r in distributed.run(overlap_worker, 2):
        assert not [w for w in r[True]["warnings"] if "gradients changed" in w]
        assert r[True]["momentum"] == r[False]["momentum"] > 0
        for a, b in zip(r[False]["params"], r[True]["params"]):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["hf_example.py", "accelerate_example.py", "lightning_example.py"])
def test_integration_example_runs_as_written_on_the_gpu(tmp_path, name):
    """docs/integrations.md's example with its GPU flags (chosen by torch.cuda.is_available()): one process on
    the GPU, as `torchrun --nproc-per-node 1` (HF, accelerate) or `python` (Lightning: one process per GPU)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests.test_docs_integrations import examples

    pytest.importorskip({"hf_example.py": "transformers", "accelerate_example.py": "accelerate",
                         "lightning_example.py": "lightning"}[name])
    code, _ = examples()[name]
    (tmp_path / name).write_text(code)
    launcher = [sys.executable] if name == "lightning_example.py" else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (loss,) = re.findall(r"rank 0: \w+_loss (\d+\.\d{4})", done.stdout)
    assert 0 < float(loss) < 1.386 and any((tmp_path / "final").iterdir())
