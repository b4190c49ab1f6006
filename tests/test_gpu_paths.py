"""What a GPU run depends on, tested on the CPU: overlap under loss scaling and
clipping (and the harness's fp16 telling it the scale), the fp16 exchange at large
n, host synchronisations in a step, 1-bit LAMB under fp16, each rank bound to its
own GPU. The masks, a pure function of (seed, step, k, position): tests/test_masks.py."""
from __future__ import annotations

import collections
import re
import types
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slamb
from tests import distributed

# ----------------------------------------------------------------------------- overlap


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(100, 120)  # compressed
        self.b = torch.nn.Linear(120, 40)  # always averaged
        self.c = torch.nn.Linear(40, 300)  # compressed

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def overlap_setup(overlap: bool, fused: bool = False):
    """The same model and SLAMB on every rank, under DDP with small buckets (several exchanges per step)."""
    torch.manual_seed(0)
    model = Net()
    opt = slamb.SLAMB(model.parameters(), lr=0.01, weight_decay=0.01, compress_ratio=0.2, sync_interval=3,
                      overlap=overlap, fused=fused)
    return model, opt, slamb.wrap_model(model, opt, bucket_cap_mb=0.05)


# how the gradients change between backward and step(), and whether the step is the fused one
OVERLAP_CASES = (("told", False), ("untold", False), ("clip", False), ("told", True), ("clip", True))


def overlap_worker(rank, world, cases=OVERLAP_CASES):
    """Every case in one process: the fused cases share their compiled graphs, as a run's steps do."""
    return {case: overlap_run(rank, *case) for case in cases}


def overlap_run(rank, mode, fused, steps=5):
    import warnings

    out = {}
    for overlap in (False, True):
        model, opt, ddp = overlap_setup(overlap, fused)
        scale = 1024.0
        if mode == "told":
            opt.grad_scale = scale
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, steps + 1):
                gen = torch.Generator().manual_seed(1000 * rank + t)
                x = torch.randn(8, 100, generator=gen)
                opt.zero_grad()
                loss = ddp(x).square().mean()
                if t == 2 and overlap:  # count the draws backward makes (the hook must not draw)
                    draw, draws = opt._mask_fn, []
                    opt._mask_fn = lambda *a: draws.append(a) or draw(*a)
                if mode in ("told", "untold"):
                    (loss * scale).backward()
                    for p in model.parameters():
                        p.grad.mul_(1.0 / scale)  # unscaled by hand, as a loss scaler does
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)  # each rank its own factor
                if t == 2 and overlap:
                    out["draws_in_backward"] = len(draws)
                    opt._mask_fn = draw
                opt.step()
        out[overlap] = {"params": [p.detach().clone() for p in model.parameters()],
                        "warnings": [str(w.message) for w in caught]}
    return out


@pytest.mark.multiprocess
def test_overlap_equals_plain_path_under_loss_scaling_and_clipping():
    """A loss scale given as grad_scale is divided out in the hook (the same bits as the plain path);
    one not given, or clipping, is detected at step() and the step falls back to the plain exchange. Fused, the
    hook gathers each bucket by positions and the check reads them back from the flat gradient buffer."""
    for ranks in distributed.run(overlap_worker, 2):
        assert list(ranks) == list(OVERLAP_CASES)
        for (mode, fused), r in ranks.items():
            for a, b in zip(r[False]["params"], r[True]["params"]):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m: f"{mode}, fused={fused}: {m}")
            assert r[False]["warnings"] == [], (mode, fused)
            fell_back = [w for w in r[True]["warnings"] if "gradients changed between backward and step()" in w]
            assert len(fell_back) == (0 if mode == "told" else 1), (mode, fused)  # warned once, not every step
            assert r["draws_in_backward"] == 0, (mode, fused)  # the step before drew this step's mask


def harness_fp16_worker(rank, world, steps=4):
    """fp16 through harness.amp (autocast, dynamic loss scale, rank-agreed step) with and without overlap."""
    import warnings

    from harness.amp import MixedPrecision

    out = {}
    for overlap in (False, True):
        model, opt, ddp = overlap_setup(overlap)
        # growth every 2 steps: the scale the optimizer is told must follow the scaler's
        amp = MixedPrecision("fp16", torch.device("cpu"), init_scale=1024.0, growth_interval=2, optimizer=opt)
        momentum, scales = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(1, steps + 1):
                x = torch.randn(8, 100, generator=torch.Generator().manual_seed(1000 * rank + t))
                opt.zero_grad()
                with amp.autocast():
                    loss = ddp(x).float().square().mean()
                amp.backward(loss)
                scales.append((amp.scale, opt.grad_scale))
                skipped, _ = amp.step(opt, model.parameters())
                assert not skipped
                momentum.append(opt.ledger.last_step["momentum"].payload)
        out[overlap] = {"params": [p.detach().clone() for p in model.parameters()], "momentum": momentum,
                        "scales": scales, "warnings": [str(w.message) for w in caught]}
    return out


@pytest.mark.multiprocess
def test_harness_fp16_tells_an_overlapping_slamb_its_loss_scale():
    """An fp16 run with overlap through the harness: the exchange started in backward is the plain path's
    (no fallback, the same momentum bytes per step, the same parameters)."""
    for r in distributed.run(harness_fp16_worker, 2):
        plain, overlap = r[False], r[True]
        assert not [w for w in overlap["warnings"] if "gradients changed between backward and step()" in w]
        assert overlap["momentum"] == plain["momentum"] and min(plain["momentum"]) > 0
        assert [s for s, _ in overlap["scales"]] == [1024.0, 1024.0, 2048.0, 2048.0]
        assert all(told == scale for scale, told in overlap["scales"])
        for a, b in zip(plain["params"], overlap["params"]):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- host synchronisations


class HostReads(TorchDispatchMode):
    """What stalls a GPU step, counted on the CPU: a scalar read to the host (``item``, ``bool``, ``int``,
    ``float``), a tensor made from host data (``torch.tensor``: a host-to-device copy), and ``tolist``."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts["scalar"] += 1
        elif func is torch.ops.aten.lift_fresh.default:
            self.counts["from_host"] += 1
        return func(*args, **(kwargs or {}))


def host_reads(fn, monkeypatch) -> dict:
    mode = HostReads()
    tolist = torch.Tensor.tolist

    def counted(self):
        mode.counts["tolist"] += 1
        return tolist(self)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", counted)
        with mode:
            fn()
    return dict(mode.counts)


@pytest.mark.parametrize("variant", ["v1", "v2"])
@pytest.mark.parametrize("nonfinite", ["raise", "ignore"])
def test_host_reads_in_a_slamb_step(variant, nonfinite, monkeypatch):
    """Per step: the rank-agreed step decision (one scalar read: step, skip a non-finite or empty step,
    grow the layout; the non-finite screen rides on it and reads again only on a step it flags), the selection's
    per-tensor counts (one tolist) and the trust-ratio scalars of all parameter groups (one tolist);
    the mask draw reads nothing and nothing is copied from the host."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 120), torch.nn.Linear(120, 40), torch.nn.Linear(40, 300))
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() == 1]}]
    opt = slamb.SLAMB(groups, variant=variant, min_compress_numel=1000, nonfinite=nonfinite)
    for t in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        counts = host_reads(opt.step, monkeypatch)
    assert counts == {"tolist": 2, "scalar": 1}
    if variant == "v2":
        assert host_reads(lambda: opt._mask_fn(7, 0.1), monkeypatch) == {}


def test_onebit_packing_makes_no_tensor_from_host_data(monkeypatch):
    from slamb.compression.onebit import pack_bits, unpack_bits

    bits = torch.rand(1000) > 0.5
    pack_bits(bits)
    assert host_reads(lambda: unpack_bits(pack_bits(bits), 1000), monkeypatch) == {}


# ----------------------------------------------------------------------------- device binding


class OnCuda(torch.nn.Module):
    """A model whose parameters report a CUDA device (torch.device objects need no GPU)."""

    def __init__(self, *indices):
        super().__init__()
        self.indices = indices

    def parameters(self, recurse=True):
        return iter([types.SimpleNamespace(device=torch.device("cuda", i)) for i in self.indices])


@pytest.fixture
def eight_gpus(monkeypatch):
    """A node of 8 GPUs whose current device the test sets (``cuda.current = i``)."""
    cuda = types.SimpleNamespace(current=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda.current)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    return cuda


@pytest.mark.parametrize("local_rank, current, indices, refused", [
    (3, 0, (0,), True),  # the README's old snippet: no set_device, every rank on cuda:0
    (3, 3, (0,), True),  # set_device(3), model still built on cuda:0
    (0, 0, (0, 1), True),  # split over two GPUs
    (3, 3, (3,), False),
    (0, 0, (0,), False),
])
def test_wrap_model_refuses_a_model_off_the_current_device(eight_gpus, monkeypatch, local_rank, current, indices,
                                                           refused):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    eight_gpus.current = current
    if not refused:
        slamb.ddp.check_current_device(OnCuda(*indices))
        return
    with pytest.raises(ValueError) as caught:
        slamb.ddp.check_current_device(OnCuda(*indices))
    message = str(caught.value)
    assert "\n" not in message and "torch.cuda.set_device(local_rank) before building the model" in message
    assert f"current CUDA device is cuda:{current} (LOCAL_RANK={local_rank})" in message


def test_a_cpu_model_is_not_asked_for_a_cuda_device(monkeypatch):
    def no_cuda():
        raise AssertionError("a CPU model must not query CUDA")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda)
    slamb.ddp.check_current_device(torch.nn.Linear(2, 2))


def test_wrap_model_checks_the_device_before_building_ddp(eight_gpus, monkeypatch):
    """Under a process group of several ranks the check runs before DDP's first broadcast."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(slamb.ddp.comm, "world_size", lambda group=None: 2)

    class NoDDP(torch.nn.parallel.DistributedDataParallel):  # a class still: wrap_model also refuses DDP modules
        def __init__(self, *args, **kwargs):
            raise AssertionError("DDP built before the device check")

    monkeypatch.setattr(slamb.ddp, "DistributedDataParallel", NoDDP)
    opt = slamb.create_optimizer("lamb", torch.nn.Linear(2, 2), lr=0.1)
    with pytest.raises(ValueError, match=r"call torch\.cuda\.set_device\(local_rank\)"):
        slamb.wrap_model(OnCuda(0), opt)


def test_snippets_bind_each_rank_to_its_gpu_before_cuda_work():
    """Every Python snippet of the README and docs that starts NCCL or moves a model to CUDA calls
    torch.cuda.set_device first: without it every rank of a node builds on cuda:0."""
    root = Path(__file__).resolve().parents[1]
    checked = 0
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            uses = [m.start() for m in re.finditer(r'init_process_group\("nccl"|\.cuda\(\)|device="cuda"', block)]
            if uses:
                checked += 1
                bind = block.find("torch.cuda.set_device(")
                assert 0 <= bind < min(uses), f"{page.name}: a snippet uses CUDA before torch.cuda.set_device"
    assert checked >= 1  # the README's own-loop snippet


# ----------------------------------------------------------------------------- optimizer time on CUDA


class FakeDevice:
    """A CUDA stream imitated on the CPU: work queued moves ``queued`` on; the host knows how far the
    device has come (``done``) only from an event's synchronize(), as a real event's elapsed_time raises
    cudaErrorNotReady before its end has completed."""

    def __init__(self):
        self.queued, self.done, self.syncs = 0.0, 0.0, 0
        device = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self, stream=None):
                self.at = device.queued

            def synchronize(self):
                device.syncs += 1
                device.done = max(device.done, self.at)

            def elapsed_time(self, end):
                if max(self.at, end.at) > device.done:
                    raise RuntimeError("CUDA error: device not ready")
                return 1000.0 * (end.at - self.at)

        self.Event = Event


class QueuingSGD(torch.optim.SGD):
    """An SGD whose step queues 0.25 s of device work."""

    def __init__(self, params, device):
        super().__init__(params, lr=0.1)
        self.device = device

    def step(self, closure=None):
        self.device.queued += 0.25
        return super().step(closure)


def no_wait(*args, **kwargs):
    raise AssertionError("a step waited for the device")


def test_cuda_optimizer_time_is_read_from_events_at_log_time_only(monkeypatch):
    from harness.amp import MixedPrecision

    device = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", device.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_wait)
    monkeypatch.setattr(torch.accelerator, "synchronize", no_wait)
    w = torch.nn.Parameter(torch.ones(3))
    opt = QueuingSGD([w], device)
    amp = MixedPrecision("fp32", torch.device("cuda"))
    assert amp.time_steps and amp.step_seconds == 0.0

    def steps(n):
        for _ in range(n):
            w.grad = torch.ones(3)
            device.queued += 1.0  # forward and backward before the step: not the optimizer's
            amp.step(opt, [w])

    steps(3)
    assert device.syncs == 0  # no step waited
    assert amp.step_seconds == pytest.approx(0.75) and device.syncs == 1  # one wait, at the read
    assert amp.step_seconds == pytest.approx(0.75) and device.syncs == 1  # nothing new: no wait
    steps(2)
    assert device.syncs == 1
    assert amp.step_seconds == pytest.approx(1.25) and device.syncs == 2
    assert w.detach().tolist() == pytest.approx([0.5] * 3)  # the steps themselves ran


def test_cpu_optimizer_time_is_the_host_clock(monkeypatch):
    from harness import amp as amp_module

    monkeypatch.setattr(torch.cuda, "Event", no_wait)
    clock = iter([10.0, 10.5, 20.0, 20.25])
    monkeypatch.setattr(amp_module.time, "perf_counter", lambda: next(clock))
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    amp = amp_module.MixedPrecision("fp32", torch.device("cpu"))
    for _ in range(2):
        w.grad = torch.ones(3)
        amp.step(opt, [w])
    assert amp.time_steps and amp.step_seconds == 0.75
