"""Per-GPU memory of BERT-Large and BERT-XL pre-training under LAMB, 1-bit LAMB and SLAMB.

    python -m bench.memory [--out results/bench/memory.md]

Computed, not measured on a GPU. The bytes of each optimizer come from the
real optimizer objects, run on BERTs of two sizes (the pre-training model's
layer types; 52M and 107M parameters) in a gloo group of 2 processes, and the
line through the two sizes (a fixed part and a part per parameter) carries
them to BERT-Large and BERT-XL: a buffer of bounded size (the mask's scratch)
is not charged per parameter. What is measured:

* counted from the objects: the bytes of the tensors in ``state_dict()``
  (state) and of the other tensors the optimizer keeps as attributes between
  steps (scratch: reused buffers, caches, the next step's mask), each storage
  once, the parameters and gradients excluded; and whether the DDP that
  :func:`slamb.wrap_model` builds for the optimizer keeps its buckets as the
  gradients' storage (``gradient_as_bucket_view``: no bucket copy) or beside
  them (one more copy of the gradients);
* measured on the CPU: the transient peak of the first step (it builds the
  optimizer's state and, for SLAMB, averages the parameters: a sync step), of
  a later step, and of a resume (``load_state_dict`` of a saved state, then a
  step), each as the process's peak resident memory (``VmHWM``, reset before
  the step) above its resident memory after it. The loaded state dict is read
  to the CPU (``map_location="cpu"``, as the harness does), where it stays on a
  GPU run: the optimizers copy it into their device buffers, so its bytes are
  subtracted from the load's peak (and counted as host memory). Freed blocks
  of 1 MiB or more go back to the OS (``MALLOC_MMAP_THRESHOLD_``), so the peak
  shows temporaries as a GPU's allocator peak would;
* measured on the CPU as well: the transient of DDP's bucket rebuild (DDP rebuilds its buckets in the
  second iteration's forward: the peak of that forward and backward above the third's), and of the
  evaluation of the ranks' average (:class:`slamb.averaged_model` clones each rank's own floating-point
  parameters and buffers while the average is evaluated, and stages the all-reduce in one bucket);
* apart, host memory: v1's cut of its cyclic mask (a ``randperm`` of every coordinate, drawn on the CPU
  whatever the device, at the first step and after a resume) is timed in its own window inside the step,
  and the loaded checkpoint is read to the CPU; neither is charged to the GPU.

These are carried to the models' parameter counts (built from
``configs/model/*.yaml`` on the meta device) and added to the parameters and
gradients of fp16 mixed precision with fp32 master weights (the harness's:
fp32 parameters and gradients, autocast's fp16 weight copies live from the
forward to the end of backward), and to the activations of a micro-batch
(:func:`activation_bytes`: the peak of the bytes alive beside the weights in a
training forward and backward of BertForPreTraining on the CPU, at small sizes,
fitted per token and layer and carried to each model at sequence 128 and the
configured micro-batch, ``configs/data/bert_phase1.yaml``). The CUDA context,
NCCL's buffers, the evaluation's own forward and allocator fragmentation are
excluded.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import tempfile
from pathlib import Path

import torch
import torch.utils._pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from bench.memory_model import AUTOCAST_COPY, GPU_BYTES, GPUS_PER_NODE, WORD, activations, per_token_bytes
from bench.memory_sharded import BERT_7B, render as render_sharded
from bench.shapes import CONFIGS, MODELS

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "bench" / "memory.md"
# first/later/resume: the step's device transient; rebuild: DDP's bucket rebuild; eval: the averaged model's;
# clone: what averaged_model keeps (counted); *_host: host memory (v1's cut, the loaded checkpoint)
PHASES = ("state", "scratch", "first", "later", "resume", "rebuild", "eval", "clone", "first_host",
          "resume_host")
SEQ = 128
# activations are measured at these (hidden size, layers), each at two micro-batches, and checked at HELD_OUT
ACT_SIZES = ((128, 1), (128, 2), (256, 1), (256, 2))
ACT_BATCHES = (4, 8)  # large enough that the per-token bytes, not a weight-sized transient, make the peak
HELD_OUT = (384, 3)


def _bert_config(hidden: int, layers: int, vocab_size: int = 30528) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                intermediate_size=4 * hidden, max_position_embeddings=512, type_vocab_size=2)


# the BERTs the optimizers run on: the pre-training model's layer types at two sizes (52M and 107M
# parameters), both large enough that every buffer with a size cap (the mask's scratch) has reached it
BERTS = tuple(_bert_config(h, layers) for h, layers in ((768, 4), (1024, 6)))


def rows() -> dict:
    """Optimizer rows: (registry name, settings); SLAMB's with its default and its fused step."""
    return {"lamb": ("lamb", {}), "onebit_lamb": ("onebit_lamb", {"freeze_step": 2}),
            "slamb_v2": ("slamb", {"variant": "v2"}), "slamb_v1": ("slamb", {"variant": "v1"}),
            "slamb_v2_fused": ("slamb", {"variant": "v2", "fused": True}),
            "slamb_v1_fused": ("slamb", {"variant": "v1", "fused": True})}


def _tensors(obj, depth: int = 0, limit: int = 8):
    """Every tensor reachable from ``obj`` through dicts, lists, tuples and object attributes."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < limit and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1, limit)
    elif depth < limit and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1, limit)
    elif depth < limit and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        yield from _tensors(vars(obj), depth + 1, limit)


def _storages(tensors, exclude=()) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage among ``tensors`` (not in ``exclude``)."""
    from slamb.sharding import local

    out = {}
    for t in tensors:
        t = local(t)  # a sharded (FSDP2) tensor: this rank's shard
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            out[s.data_ptr()] = s.nbytes()
    return out


def counted_bytes(opt, params) -> dict:
    """Bytes of the optimizer's ``state_dict()`` tensors (state) and of its other tensor attributes
    (scratch), each storage once, parameters and gradients excluded."""
    own = _storages([p for p in params] + [p.grad for p in params if p.grad is not None])
    # the live state (``opt.state``) may be views into flat buffers that ``state_dict()`` does not return
    live = _storages(_tensors(dict(opt.state)), own)
    internals = {k: v for k, v in vars(opt).items() if k not in ("param_groups", "state", "defaults")}
    held = _storages(_tensors(internals), own)
    # a tensor state_dict() makes afresh (a converted copy) is not held
    saved = {k: v for k, v in _storages(_tensors(opt.state_dict()), own).items() if k in held or k in live}
    state = {**saved, **live}
    scratch = {k: v for k, v in held.items() if k not in state}
    return {"state": sum(state.values()), "scratch": sum(scratch.values())}


class Resident:
    """The process's resident memory now and its peak since :meth:`reset` (Linux ``/proc``)."""

    @staticmethod
    def _read() -> dict[str, int]:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith("Vm"))
        return {k: int(v.split()[0]) * 1024 for k, v in fields.items()}

    def reset(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size

    def now(self) -> int:
        return self._read()["VmRSS"]

    def peak(self) -> int:
        return self._read()["VmHWM"]


def _bert(config: dict):
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    return BertForPreTraining(BertConfig(**config))


def _backward(model, vocab_size: int, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, vocab_size, (2, 32), generator=gen)
    out = model(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(2, dtype=torch.long))
    out.loss.backward()


class HostCut:
    """v1's cut (``CyclicMask._recut``) runs on the CPU on every device: inside a step it gets a window of its
    own, whose peak is host memory on a GPU run, and the step's device peak is the larger of the windows
    before and after it. Patches the class while entered (in the measuring process only)."""

    def __init__(self, res: Resident):
        self.res = res
        self.start()

    def start(self) -> None:
        self.before, self.host = 0, 0

    def __enter__(self):
        from slamb.optim import masks

        self._masks, self._orig = masks, masks.CyclicMask._recut

        def recut(mask, *args, **kwargs):
            self.before = max(self.before, self.res.peak())
            self.res.reset()
            base = self.res.now()
            self._orig(mask, *args, **kwargs)
            gc.collect()
            self.host = max(self.host, self.res.peak() - base)
            self.res.reset()

        masks.CyclicMask._recut = recut
        return self

    def __exit__(self, *exc) -> None:
        self._masks.CyclicMask._recut = self._orig

    def device_peak(self) -> int:
        return max(self.before, self.res.peak())


def measure(rank: int, world: int, row: str, folder: str, config: dict) -> dict:
    """One row on one rank of a gloo group: counted bytes, DDP's buckets, and the measured transients."""
    import slamb

    name, settings = rows()[row]
    res = Resident()
    model = _bert(config)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    build = lambda: slamb.create_optimizer(name, model.parameters(), lr=1e-3, weight_decay=0.01,  # noqa: E731
                                           **settings)
    opt = build()
    ddp = slamb.wrap_model(model, opt)
    out = {"numel": numel, "ddp": ddp is not model,
           "bucket_view": bool(getattr(ddp, "gradient_as_bucket_view", False))}
    _backward(ddp, config["vocab_size"], rank, 1)

    with HostCut(res) as cut:
        def timed_step(key: str) -> None:
            cut.start()
            res.reset()
            opt.step()
            gc.collect()
            out[key] = cut.device_peak() - res.now()
            out[key + "_host"] = cut.host

        timed_step("first")  # builds the state; SLAMB averages the parameters after it (a sync step)
        passes = {}
        for step in range(2, 5):  # 1-bit LAMB leaves its warm-up (freeze_step=2): the compressed stage's state
            opt.zero_grad(set_to_none=False)
            res.reset()
            _backward(ddp, config["vocab_size"], rank, step)
            gc.collect()
            passes[step] = res.peak() - res.now()
            opt.step()
        # DDP rebuilds its buckets in the second iteration's forward; the third does the same work without it
        out["rebuild"] = max(0, passes[2] - passes[3])
        opt.zero_grad(set_to_none=False)
        _backward(ddp, config["vocab_size"], rank, 5)
        timed_step("later")
        out.update(counted_bytes(opt, params))
        res.reset()
        with slamb.averaged_model(ddp) as avg:
            out["clone"] = sum(_storages(avg.saved or ()).values())
        gc.collect()
        out["eval"] = res.peak() - res.now()
        path = os.path.join(folder, f"opt{rank}.pt")
        torch.save(opt.state_dict(), path)
        del opt
        gc.collect()
        opt = build()
        loaded = torch.load(path, map_location="cpu", weights_only=False)
        host = sum(_storages(_tensors(loaded)).values())  # in host memory on a GPU run, as loaded here
        res.reset()
        opt.load_state_dict(loaded)
        del loaded
        gc.collect()
        load = res.peak() - res.now() - host
        opt.zero_grad(set_to_none=False)
        _backward(ddp, config["vocab_size"], rank, 6)
        timed_step("resume")
        # slamb.load_optimizer drops the loaded file before training resumes: the load and the cut never overlap
        out["resume"] = max(load, out["resume"])
        out["resume_host"] = max(host, out["resume_host"])
    return out


def measure_rows(names=None, configs=BERTS) -> dict[str, dict]:
    """Every row at every size of ``configs``, each in a fresh gloo group of 2 processes, averaged over the
    ranks. Per phase: bytes per parameter, and with two sizes the line through them, bytes = fixed +
    per parameter x parameters (``<phase>_fixed``): buffers of a bounded size are not per-parameter costs."""
    from harness.local import run_local

    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)  # read by the spawned workers' glibc at start
    try:
        out = {}
        for row in names or rows():
            points = []
            for config in configs:
                with tempfile.TemporaryDirectory() as folder:
                    ranks = run_local(measure, 2, row, folder, config)
                points.append((ranks[0]["numel"], {k: sum(r[k] for r in ranks) / len(ranks) for k in PHASES}))
            (n0, b0), (n1, b1) = points[0], points[-1]
            per = {}
            for k in PHASES:
                per[k] = (b1[k] - b0[k]) / (n1 - n0) if n1 != n0 else b0[k] / n0
                per[k + "_fixed"] = b0[k] - per[k] * n0
            out[row] = {**per, "ddp": ranks[0]["ddp"], "bucket_view": ranks[0]["bucket_view"],
                        "numel": [n for n, _ in points], "measured": [b for _, b in points]}
        return out
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_")
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


class _Live(TorchDispatchMode):
    """The bytes of the storages alive between ops, and their peak: what a GPU allocator holds, each tensor
    made by an op counted from that op until its last reference goes (storages in ``exclude`` left out)."""

    def __init__(self, exclude=()):
        super().__init__()
        self.exclude = set(exclude)
        self.alive: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr, (ref, nbytes) in list(self.alive.items()):  # freed before this op's outputs can reuse them
            if ref.expired():
                del self.alive[ptr]
                self.total -= nbytes
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() and s.data_ptr() not in self.exclude and s.data_ptr() not in self.alive:
                    self.alive[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                    self.total += s.nbytes()
        self.peak = max(self.peak, self.total)
        return out


def activation_bytes(config: dict, batch: int, seq: int = SEQ) -> dict:
    """One training forward and backward of BertForPreTraining on the CPU under autocast to a 2-byte float:
    the peak of the bytes alive beside the parameters and gradients (``peak``) and the bytes of the tensors
    saved for backward, each storage once (``saved``); both include autocast's weight copies.

    bfloat16 stands for CUDA's float16 (the same size; matmuls and SDPA in it, LayerNorm and the loss in
    fp32 by type promotion and autocast's lists). Dropout is off: the CPU's dropout keeps its mask in the
    input's dtype where CUDA's fused kernel keeps one byte (added by :func:`dropout_mask_bytes`), and the
    CPU's SDPA takes the math path under dropout, keeping the heads x seq x seq probabilities that CUDA's
    flash kernel replaces by one fp32 logsumexp per head and token (its dropout is a random seed)."""
    model = _bert({**config, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    params = list(model.parameters())
    for p in params:  # the harness zeroes gradients in place: they are there before backward
        p.grad = torch.zeros_like(p)
    own = {t.untyped_storage().data_ptr() for t in params + [p.grad for p in params]}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=gen)
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    nsp = torch.zeros(batch, dtype=torch.long)
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in own:
            saved[s.data_ptr()] = s.nbytes()
        return t

    live = _Live(own)
    with live:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels, next_sentence_label=nsp).loss
        loss.backward()
    return {"peak": live.peak, "saved": sum(saved.values()), "numel": sum(p.numel() for p in params)}


def activation_fit(sizes=ACT_SIZES, batches=ACT_BATCHES, seq: int = SEQ, vocab_size: int = 30528) -> dict:
    """Bytes per token of the activations, L (a h + c) + (f h + g) for L layers of hidden size h (64-dim
    heads), through the per-sequence slopes measured at ``sizes`` x ``batches`` (two hidden sizes, one and
    two layers each; the head's terms, f h + g, hold the vocabulary-sized logits). The part that does not
    grow with the micro-batch (``fixed``: the peak less the slope's bytes and autocast's weight copies) is
    reported, not carried."""
    points = []
    for hidden, layers in sizes:
        got = [activation_bytes(_bert_config(hidden, layers, vocab_size), b, seq) for b in batches]
        per_token = (got[1]["peak"] - got[0]["peak"]) / ((batches[1] - batches[0]) * seq)
        fixed = got[0]["peak"] - per_token * batches[0] * seq - AUTOCAST_COPY * got[0]["numel"]
        points.append({"hidden": hidden, "layers": layers, "per_token": per_token, "fixed": fixed,
                       "numel": got[0]["numel"], "peak": [g["peak"] for g in got], "saved": [g["saved"] for g in got]})
    by = {(q["hidden"], q["layers"]): q["per_token"] for q in points}
    (h0, _), (h1, _) = sizes[0], sizes[-1]
    layer = {h: by[(h, 2)] - by[(h, 1)] for h in (h0, h1)}
    head = {h: by[(h, 1)] - layer[h] for h in (h0, h1)}
    a = (layer[h1] - layer[h0]) / (h1 - h0)
    f = (head[h1] - head[h0]) / (h1 - h0)
    return {"a": a, "c": layer[h0] - a * h0, "f": f, "g": head[h0] - f * h0, "seq": seq, "points": points}


def configured_micro_batch() -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(CONFIGS / "data" / "bert_phase1.yaml").micro_batch)


def model_shape(name: str) -> tuple[int, int]:
    """(hidden size, layers) of ``configs/model/<name>.yaml``."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(CONFIGS / "model" / f"{name}.yaml")
    return int(cfg.hidden_size), int(cfg.num_hidden_layers)


def model_bytes(per: dict, params: int, acts: float = 0.0) -> dict:
    """Per-GPU bytes of one optimizer row for a model of ``params`` parameters with ``acts`` bytes of
    activations (see the module docstring); ``host``: the host bytes per rank."""
    def of(k):
        return per[k] * params + per.get(k + "_fixed", 0.0)

    b = {"params": WORD * params, "grads": WORD * params,
         "buckets": WORD * params if per["ddp"] and not per["bucket_view"] else 0,
         "state": of("state"), "scratch": of("scratch")}
    b["resident"] = sum(b.values())
    b["fwd_bwd"] = b["resident"] + AUTOCAST_COPY * params  # without activations: bench.gpu_check reads it
    b["activations"] = acts
    b["training"] = b["fwd_bwd"] + acts
    b["rebuild"] = b["training"] + of("rebuild")  # the second iteration's forward and backward
    b["first"] = b["resident"] + of("first")
    b["later"] = b["resident"] + of("later")
    b["resume"] = b["resident"] + of("resume")
    b["eval"] = b["resident"] + of("eval")
    b["peak"] = max(b[k] for k in ("training", "rebuild", "first", "later", "resume", "eval"))
    b["fits"] = b["peak"] <= GPU_BYTES
    b["host"] = max(of("first_host"), of("resume_host"))
    return b


def largest_micro_batch(per: dict, params: int, per_sequence: float) -> int:
    """The largest micro-batch whose peak fits the GPU (0: none does)."""
    b = model_bytes(per, params)
    if max(b["first"], b["later"], b["resume"], b["eval"]) > GPU_BYTES:
        return 0
    return max(0, math.floor((GPU_BYTES - b["rebuild"]) / per_sequence))


def render(per_row: dict, models: dict[str, dict], fit: dict, micro_batch: int, calibration: dict | None = None,
           held_out: dict | None = None, sharded: dict[str, dict] | None = None) -> str:
    """The page. ``models``: name -> {"params", "hidden", "layers"}; ``calibration``: the GPU's measured
    activations of BERT-Large (GB by micro-batch); ``held_out``: a size measured apart from the fit;
    ``sharded``: the models of the FSDP2 section (:func:`bench.memory_sharded.render`), with their
    ``named_shapes``."""
    gb = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    sizes = " and ".join(f"{n / 1e6:.0f}M" for n in next(iter(per_row.values()))["numel"])
    act_sizes = ", ".join(f"h {q['hidden']} x {q['layers']}" for q in fit["points"])
    out = [
        "# Per-GPU memory of BERT pre-training (computed)",
        "",
        "Generated by `python -m bench.memory`. Computed on the CPU, not measured on a GPU; the activation model "
        "is set beside a GPU measurement below. Bytes per parameter of each optimizer "
        f"from the real optimizer objects on BERTs of {sizes} parameters (the pre-training model's layer "
        "types) in a gloo group of 2 CPU processes, carried to each model's parameter count by the line "
        "through the two sizes (bytes = fixed + per parameter x parameters: buffers of bounded size, such as "
        "the mask's scratch, are not charged per parameter); fp16 mixed precision with fp32 master weights "
        f"(fp32 parameters and gradients, autocast's fp16 weight copies, {AUTOCAST_COPY} bytes per parameter, "
        f"from the forward to the end of backward); activations at sequence {fit['seq']} and the configured "
        f"micro-batch, {micro_batch} (`configs/data/bert_phase1.yaml`). The CUDA context, NCCL's buffers, the "
        "evaluation's own forward and allocator fragmentation are excluded. GPU: "
        f"{GPU_BYTES / 1e9:.0f}e9 bytes (an 80 GB A100 or H100).",
        "",
        "## Activations",
        "",
        "Measured on the CPU (`activation_bytes`): one training forward and backward of HF's BertForPreTraining "
        "(SDPA attention, 64-dim heads, vocabulary 30,528, MLM labels on 15% of the tokens) under autocast to "
        "bfloat16, which stands for CUDA's float16 (2 bytes; matmuls and attention in it, LayerNorm and the "
        "loss in fp32), with gradients allocated beforehand as the harness keeps them. Every storage an op makes "
        "is followed from that op until its last reference goes; the peak of their bytes beside the parameters "
        "and gradients, less autocast's weight copies, is what `make gpu-check` reports as activations (the "
        "allocator's peak less the weights, the optimizer state and the copies). Dropout is off on the CPU, "
        "for two reasons: its CPU path keeps a mask in the input's dtype where CUDA's fused kernel keeps one "
        "byte, and under attention dropout the CPU's SDPA takes the math path and keeps the heads x seq x seq "
        "probabilities, where CUDA's flash kernel keeps an fp32 logsumexp per head and token (its dropout is a "
        "seed). CUDA's one-byte masks are added: (2 L + 1) h bytes per token (after the embeddings and after "
        "each layer's attention and feed-forward blocks).",
        "",
        f"Fit, bytes per token at sequence {fit['seq']}, for L layers of hidden size h: "
        f"L x ({fit['a']:.2f} h + {fit['c']:.0f}) + ({fit['f']:.2f} h + {fit['g']:,.0f}) + (2 L + 1) h. "
        f"The head's {fit['g']:,.0f} bytes are the vocabulary's: fp32 log-probabilities kept for backward and "
        "their gradients at the start of backward, about 12 bytes per token and vocabulary entry. Measured at "
        f"({act_sizes}), micro-batches {ACT_BATCHES[0]} and {ACT_BATCHES[1]}: each size's per-token bytes are "
        "the slope between the two; the fit goes through the four.",
        "",
        "| size | parameters | measured bytes per token | fit | fixed part (MB, not carried) |",
        "|---|---:|---:|---:|---:|",
    ]
    for q in fit["points"] + ([held_out] if held_out else []):
        label = f"h {q['hidden']} x {q['layers']}" + (" (held out)" if q is held_out else "")
        pred = per_token_bytes(fit, q["hidden"], q["layers"], cuda_dropout=False)
        out.append(f"| {label} | {q['numel'] / 1e6:.1f}M | {q['per_token']:,.0f} | {pred:,.0f} | "
                   f"{q['fixed'] / 1e6:.1f} |")
    out += ["", "Measured and fit columns are without the dropout masks (as measured). The fixed part is the "
            "peak at the smaller micro-batch less the per-token bytes and autocast's copies: a weight-sized "
            "transient of backward that the micro-batch's bytes cover at these micro-batches; it is not carried.",
            ""]
    large = models.get("BERT-Large")
    if calibration and large:
        out += ["### Beside the GPU", "",
                "`make gpu-check` on an NVIDIA H100 80GB HBM3 (`results/gpu/nvidia-h100-80gb-hbm3.md`): "
                "BERT-Large, fp16 autocast, sequence 128, the allocator's peak less parameters, gradients, "
                "optimizer state and autocast's copies, LAMB and SLAMB v2 (the same within 0.02 GB).", "",
                "| micro-batch | measured (GB) | predicted (GB) | predicted / measured |", "|---:|---:|---:|---:|"]
        for mb, measured in sorted(calibration.items()):
            pred = activations(fit, large["hidden"], large["layers"], mb) / 1e9
            out.append(f"| {mb} | {measured:.2f} | {pred:.2f} | {pred / measured:.3f} |")
        out.append("")
    out += [
        "## Bytes per parameter",
        "",
        "State and scratch are counted from the objects after 5 steps (1-bit LAMB past its warm-up): state, "
        "the tensors of `state_dict()` (and the live state they are views of); scratch, the other tensors the "
        "optimizer keeps between steps. DDP: whether `slamb.wrap_model` wraps the model for this optimizer "
        "and keeps the buckets as the gradients' storage (`gradient_as_bucket_view`), read from the DDP it "
        "builds; otherwise its buckets are one more copy of the gradients (DDP's documented behaviour; "
        "not measured: the buckets' pages are not resident until backward writes them). The transients are "
        "measured on the CPU: the peak resident memory during the step above the resident memory after it "
        "(first: the step that builds the state and, for SLAMB, averages the parameters; later: the fifth "
        "step; resume: the larger of `load_state_dict` of the saved state and the step after it), averaged over "
        "the 2 ranks. The saved state is loaded to the CPU, as the harness loads checkpoints; on a GPU run it "
        "stays in host memory while the optimizers copy it into their device buffers, so its bytes are "
        "subtracted from the load's peak and counted as host memory. v1's cut of its cyclic mask (a `randperm` "
        "of every coordinate, sorted into chunks, drawn on the CPU on every device) is timed in a window of its "
        "own inside the first and the resumed step: host memory, not in the step's column. Rebuild: DDP "
        "rebuilds its buckets in the second iteration's forward; the peak of that iteration's forward and "
        "backward above the third's. Evaluation: `slamb.averaged_model`, as the harness evaluates the ranks' "
        "average, keeps a clone of each rank's floating-point parameters and buffers (clone, counted from the "
        "object) and stages the all-reduce in one bucket; its peak above the resident memory after it. gloo's "
        "collectives may stage copies that NCCL's in-place ones do not make, so the transients of steps that "
        "communicate are upper bounds. Each cell: bytes per parameter + the fixed part (MB), from the two sizes.",
        "",
        "| optimizer | state | scratch | DDP buckets (bucket view) | first step | later step | resume | DDP rebuild "
        "| evaluation (clone) | host: first step | host: resume |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in per_row.items():
        buckets = ("no DDP" if not p["ddp"] else
                   f"{0 if p['bucket_view'] else WORD} ({'yes' if p['bucket_view'] else 'no'})")
        cell = {k: f"{p[k]:.2f} + {p.get(k + '_fixed', 0.0) / 1e6:.0f} MB" for k in PHASES}
        out.append(f"| {name} | {cell['state']} | {cell['scratch']} | {buckets} | {cell['first']} | "
                   f"{cell['later']} | {cell['resume']} | {cell['rebuild']} | {cell['eval']} ({p['clone']:.2f}) | "
                   f"{cell['first_host']} | {cell['resume_host']} |")
    for model, m in models.items():
        params, hidden, layers = m["params"], m["hidden"], m["layers"]
        per_seq = fit["seq"] * per_token_bytes(fit, hidden, layers)
        acts = micro_batch * per_seq
        out += ["", f"## {model} ({params / 1e6:,.0f}M parameters), GB per GPU", "",
                f"Activations: {per_seq / 1e9:.3f} GB per sequence of {fit['seq']} (h {hidden}, {layers} layers), "
                f"{acts / 1e9:.1f} GB at micro-batch {micro_batch}. Forward/backward is without them (the weights, "
                "the state and autocast's copies); training adds them; DDP rebuild is the second iteration's "
                "training peak. Host: per rank and per node of "
                f"{GPUS_PER_NODE} GPUs, not in the GPU's peak.", "",
                "| optimizer | parameters | gradients | DDP buckets | state | scratch | resident | forward/backward "
                f"| activations (micro-batch {micro_batch}) | training | DDP rebuild | first step | later step | resume "
                "| evaluation | peak | fits in 80 GB | largest micro-batch | host per rank | host per node |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
        for name, p in per_row.items():
            b = model_bytes(p, params, acts)
            cells = [gb(b[k]) for k in ("params", "grads", "buckets", "state", "scratch", "resident", "fwd_bwd",
                                        "activations", "training", "rebuild", "first", "later", "resume", "eval",
                                        "peak")]
            room = (GPU_BYTES - b["peak"]) / 1e9
            fits = f"yes ({room:.1f} GB left)" if b["fits"] else f"no ({-room:.1f} GB over)"
            largest = largest_micro_batch(p, params, per_seq)
            out.append(f"| {name} | {' | '.join(cells)} | {fits} | {largest if largest else 'none'} | "
                       f"{gb(b['host'])} | {gb(GPUS_PER_NODE * b['host'])} |")
    out += ["", "Resident: parameters, gradients, DDP buckets, state and scratch, held between steps. Each peak "
            "column is the resident bytes plus that phase's transient (training and DDP rebuild: plus autocast's "
            "copies and the activations); peak is the largest, fits compares it with the GPU, and the largest "
            f"micro-batch is the largest whose peak fits (sequence {fit['seq']}). Host: the larger of v1's cut "
            "and the loaded optimizer state, per rank (they never overlap: `slamb.load_optimizer` drops the file "
            "before the step that cuts). Sharded parameters, gradients and state: the next section.", ""]
    if sharded:

        out += render_sharded(sharded, fit, micro_batch, per_row["slamb_v1"]["first_host"])
    return "\n".join(out)


# the GPU page whose BERT-Large activations the fit is set beside (`make gpu-check` writes it)
CALIBRATION_PAGE = ROOT / "results" / "gpu" / "nvidia-h100-80gb-hbm3.json"


def memory_rows(res: dict) -> list[dict]:
    """The peak-memory rows of a GPU check's JSON (``bench.gpu_check``), of either layout."""
    if "format" not in res:
        return res.get("memory", [])
    return res.get("parts", {}).get("memory", {}).get("rows", [])


def calibration_gb(page: Path = CALIBRATION_PAGE) -> dict[int, float]:
    """BERT-Large's activations in GB by micro-batch, as `make gpu-check` measured them: LAMB's rows (SLAMB
    v2's differ by 0.01)."""
    rows = memory_rows(json.loads(page.read_text()))
    return {r["micro_batch"]: r["activations_gb"] for r in rows if r["optimizer"] == "lamb" and "activations_gb" in r}



def held_out_point(hidden: int, layers: int, batches=ACT_BATCHES, seq: int = SEQ) -> dict:
    """A size measured as the fit's points are, to check the fit where it was not made."""
    got = [activation_bytes(_bert_config(hidden, layers), b, seq) for b in batches]
    per_token = (got[1]["peak"] - got[0]["peak"]) / ((batches[1] - batches[0]) * seq)
    return {"hidden": hidden, "layers": layers, "numel": got[0]["numel"], "per_token": per_token,
            "fixed": got[0]["peak"] - per_token * batches[0] * seq - AUTOCAST_COPY * got[0]["numel"]}


def sharded_models() -> dict[str, dict]:
    """The models of the sharded section: BERT-Large, BERT-XL and a 7B-parameter BERT
    (:data:`bench.memory_sharded.BERT_7B`), each with its named parameter shapes."""
    from bench.shapes import bert_model_config, bert_named_shapes

    out = {}
    for label, cfg in (("BERT-Large", bert_model_config("bert_large")), ("BERT-XL", bert_model_config("bert_xl")),
                       ("BERT-7B", bert_model_config("bert_xl", **BERT_7B))):
        named = bert_named_shapes(cfg)
        out[label] = {"params": sum(math.prod(s) for _, s in named), "hidden": cfg["hidden_size"],
                      "layers": cfg["num_hidden_layers"], "named_shapes": named}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    fit = activation_fit()
    held_out = held_out_point(*HELD_OUT)
    per_row = measure_rows()
    models = {}
    for label, name in (("BERT-Large", "bert_large"), ("BERT-XL", "bert_xl")):
        hidden, layers = model_shape(name)
        models[label] = {"params": sum(math.prod(s) for s in MODELS[name]()), "hidden": hidden, "layers": layers}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(per_row, models, fit, configured_micro_batch(), calibration_gb(), held_out,
                          sharded_models()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
