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
  subtracted from the load's peak. Freed blocks of 1 MiB or more
  go back to the OS (``MALLOC_MMAP_THRESHOLD_``), so the peak shows
  temporaries as a GPU's allocator peak would.

These are carried to the models' parameter counts (built from
``configs/model/*.yaml`` on the meta device) and added to the parameters and
gradients of fp16 mixed precision with fp32 master weights (the harness's:
fp32 parameters and gradients, autocast's fp16 weight copies live from the
forward to the end of backward). Activations, the CUDA context, NCCL's
buffers and allocator fragmentation are excluded: the page bounds what the
optimizer and the weights leave for activations on an 80 GB A100.
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import tempfile
from pathlib import Path

import torch

from bench.shapes import MODELS

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "bench" / "memory.md"
GPU_BYTES = 80e9  # an 80 GB A100 (81,920 MiB; the rest is left for the context and fragmentation)
WORD = 4
AUTOCAST_COPY = 2  # bytes per parameter: autocast's fp16 copy of each fp32 weight, forward to end of backward
# the BERTs the optimizers run on: the pre-training model's layer types at two sizes (52M and 107M
# parameters), both large enough that every buffer with a size cap (the mask's scratch) has reached it
BERTS = tuple(dict(vocab_size=30528, hidden_size=h, num_hidden_layers=layers, num_attention_heads=h // 64,
                   intermediate_size=4 * h, max_position_embeddings=512, type_vocab_size=2)
              for h, layers in ((768, 4), (1024, 6)))
PHASES = ("state", "scratch", "first", "later", "resume")


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
    out = {}
    for t in tensors:
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
    # a tensor state_dict() makes afresh (a converted copy, such as the fused SLAMB's int16 age) is not held
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

    def timed_step(key: str) -> None:
        res.reset()
        opt.step()
        gc.collect()
        out[key] = res.peak() - res.now()

    timed_step("first")  # builds the state; SLAMB averages the parameters after it (a sync step)
    for step in range(2, 5):  # 1-bit LAMB leaves its warm-up (freeze_step=2): the compressed stage's state
        opt.zero_grad(set_to_none=False)
        _backward(ddp, config["vocab_size"], rank, step)
        opt.step()
    opt.zero_grad(set_to_none=False)
    _backward(ddp, config["vocab_size"], rank, 5)
    timed_step("later")
    out.update(counted_bytes(opt, params))
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
    res.reset()
    opt.step()
    gc.collect()
    out["resume"] = max(load, res.peak() - res.now())
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


def model_bytes(per: dict, params: int) -> dict:
    """Per-GPU bytes of one optimizer row for a model of ``params`` parameters (see the module docstring)."""
    def of(k):
        return per[k] * params + per.get(k + "_fixed", 0.0)

    b = {"params": WORD * params, "grads": WORD * params,
         "buckets": WORD * params if per["ddp"] and not per["bucket_view"] else 0,
         "state": of("state"), "scratch": of("scratch")}
    b["resident"] = sum(b.values())
    b["fwd_bwd"] = b["resident"] + AUTOCAST_COPY * params
    b["first"] = b["resident"] + of("first")
    b["later"] = b["resident"] + of("later")
    b["resume"] = b["resident"] + of("resume")
    b["peak"] = max(b["fwd_bwd"], b["first"], b["later"], b["resume"])
    b["fits"] = b["peak"] <= GPU_BYTES
    return b


def render(per_row: dict, models: dict[str, int]) -> str:
    gb = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    sizes = " and ".join(f"{n / 1e6:.0f}M" for n in next(iter(per_row.values()))["numel"])
    out = [
        "# Per-GPU memory of BERT pre-training (computed)",
        "",
        "Generated by `python -m bench.memory`. Not measured on a GPU. Bytes per parameter of each optimizer "
        f"from the real optimizer objects on BERTs of {sizes} parameters (the pre-training model's layer "
        "types) in a gloo group of 2 CPU processes, carried to each model's parameter count by the line "
        "through the two sizes (bytes = fixed + per parameter x parameters: buffers of bounded size, such as "
        "the mask's scratch, are not charged per parameter); fp16 mixed precision with fp32 master weights "
        f"(fp32 parameters and gradients, autocast's fp16 weight copies, {AUTOCAST_COPY} bytes per parameter, from the forward to the end of "
        "backward). Activations (micro-batch and sequence length), the CUDA context, NCCL's buffers and "
        "allocator fragmentation are excluded: the tables bound what the weights and the optimizer leave for "
        f"activations on an 80 GB A100 ({GPU_BYTES / 1e9:.0f}e9 bytes).",
        "",
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
        "subtracted from the load's peak. gloo's collectives may stage copies that NCCL's in-place ones do not "
        "make, so the transients of steps that communicate are upper bounds. Each cell: bytes per parameter "
        "+ the fixed part (MB), from the two sizes.",
        "",
        "| optimizer | state | scratch | DDP buckets (bucket view) | first step | later step | resume |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for name, p in per_row.items():
        buckets = ("no DDP" if not p["ddp"] else
                   f"{0 if p['bucket_view'] else WORD} ({'yes' if p['bucket_view'] else 'no'})")
        cell = {k: f"{p[k]:.2f} + {p.get(k + '_fixed', 0.0) / 1e6:.0f} MB" for k in PHASES}
        out.append(f"| {name} | {cell['state']} | {cell['scratch']} | {buckets} | {cell['first']} | "
                   f"{cell['later']} | {cell['resume']} |")
    for model, params in models.items():
        out += ["", f"## {model} ({params / 1e6:,.0f}M parameters), GB per GPU", "",
                "| optimizer | parameters | gradients | DDP buckets | state | scratch | resident | forward/backward "
                "| first step | later step | resume | fits in 80 GB |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, p in per_row.items():
            b = model_bytes(p, params)
            cells = [gb(b[k]) for k in ("params", "grads", "buckets", "state", "scratch", "resident", "fwd_bwd",
                                        "first", "later", "resume")]
            room = (GPU_BYTES - b["peak"]) / 1e9
            fits = f"yes ({room:.1f} GB left)" if b["fits"] else f"no ({-room:.1f} GB over)"
            out.append(f"| {name} | {' | '.join(cells)} | {fits} |")
    out += ["", "Resident: parameters, gradients, DDP buckets, state and scratch, held between steps. Each peak "
            "column is the resident bytes plus that phase's transient; fits compares the largest with the GPU. "
            "Sharding the state (ZeRO) is not modelled.", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    per_row = measure_rows()
    models = {"BERT-Large": sum(math.prod(s) for s in MODELS["bert_large"]()),
              "BERT-XL": sum(math.prod(s) for s in MODELS["bert_xl"]())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(per_row, models))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
