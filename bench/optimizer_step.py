"""Step time and memory of one optimizer step, world size 1.

    python -m bench.optimizer_step [--models bert_base resnet110] [--steps 15] [--device cpu]

Each (model, optimizer) runs in a fresh process so that its memory figures
are its own: parameters and gradients of the model's real shapes, a few
warm-up steps, then the median of ``--steps`` timed steps. Memory:

* state: bytes of every tensor the optimizer keeps between steps (its
  ``state`` and internal buffers such as SLAMB v1's cut permutation), in fp32
  words per parameter, without its scratch;
* scratch: buffers kept between steps only to be reused (SLAMB's ``_work``);
* peak: the highest memory during the timed steps beyond parameters, gradients,
  state and scratch (CUDA: ``max_memory_allocated``; CPU: peak RSS in a second
  process where glibc hands every large block back, so freed temporaries leave
  the RSS; the step time is measured with glibc's default behaviour).

Writes ``results/bench/optimizer_step.md`` (or ``--out``).
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import torch
import torch.multiprocessing as mp

from bench.shapes import MODELS

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
    "lamb": lambda p: __import__("slamb").LAMB(p, lr=1e-3, weight_decay=0.01),
    "slamb_v1": lambda p: __import__("slamb").SLAMB(p, lr=1e-3, weight_decay=0.01, variant="v1"),
    "slamb_v2": lambda p: __import__("slamb").SLAMB(p, lr=1e-3, weight_decay=0.01, variant="v2"),
    "slamb_v2_nocheck": lambda p: __import__("slamb").SLAMB(p, lr=1e-3, weight_decay=0.01, variant="v2",
                                                            nonfinite="ignore"),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensors(obj, depth=0, limit=5):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < limit and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif depth < limit and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif depth < limit and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Parameter, type)):
        yield from _tensors(vars(obj), depth + 1)


SCRATCH = ("_work",)


def state_bytes(opt, params, scratch: bool = False) -> int:
    own = {p.untyped_storage().data_ptr() for p in params}
    seen, total = set(), 0
    internals = {k: v for k, v in vars(opt).items() if k not in ("param_groups", "state")}
    if scratch:
        tensors = _tensors({k: v for k, v in internals.items() if k in SCRATCH})
    else:
        tensors = _tensors({"state": dict(opt.state), "internals": {k: v for k, v in internals.items()
                                                                    if k not in SCRATCH}})
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or ptr in own or t.device.type == "meta":
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def measure(model: str, optimizer: str, steps: int, device: str, queue) -> None:
    """Runs in its own process (see ``run_one``)."""
    torch.set_num_threads(os.cpu_count() or 1)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = MODELS[model]()
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=dev) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=dev)
    numel = sum(p.numel() for p in params)
    opt = OPTIMIZERS[optimizer](params)
    for _ in range(3):
        opt.step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    queue.put({"model": model, "optimizer": optimizer, "numel": numel, "ms": 1e3 * statistics.median(times),
               "ms_min": 1e3 * min(times), "state_words": state_bytes(opt, params) / (4 * numel),
               "scratch_words": state_bytes(opt, params, scratch=True) / (4 * numel),
               "peak_words": max(peak, 0) / (4 * numel)})


def _spawn(model, optimizer, steps, device, env: dict) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child reads its environment (and glibc its malloc tuning) at start
    try:
        proc = ctx.Process(target=measure, args=(model, optimizer, steps, device, queue))
        proc.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    result = queue.get()
    proc.join()
    return result


def run_one(model, optimizer, steps, device):
    """Time with the allocator as users have it; memory where freed temporaries leave the RSS."""
    timed = _spawn(model, optimizer, steps, device, {})
    if device == "cpu":
        # glibc returns blocks above this size to the OS when freed (and maps them afresh: slower)
        timed["peak_words"] = _spawn(model, optimizer, 3, device, {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})["peak_words"]
    return timed


def render(rows, device: str, steps: int) -> str:
    out = [
        "# Optimizer step: time and memory (world size 1)",
        "",
        f"Generated by `python -m bench.optimizer_step` on {device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}). "
        f"Median of {steps} steps after 3 warm-up steps; fp32 parameters with the real shapes of each model; "
        "each optimizer in its own process. State and peak are in fp32 words per parameter, beyond the "
        "parameter and its gradient; peak counts the step's temporaries above the resident state.",
        "",
        "| model | parameters | optimizer | step (ms) | vs LAMB | state (words/param) | scratch (words/param) "
        "| peak extra (words/param) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lamb = next(x["ms"] for x in rows if x["model"] == r["model"] and x["optimizer"] == "lamb")
        out.append(f"| {r['model']} | {r['numel'] / 1e6:.1f}M | {r['optimizer']} | {r['ms']:.1f} | "
                   f"{r['ms'] / lamb:.2f}x | {r['state_words']:.2f} | {r['scratch_words']:.2f} | "
                   f"{r['peak_words']:.2f} |")
    out += ["", "Targets (issue 2): SLAMB step <= 1.3x the LAMB step; SLAMB state <= 3 fp32 words per parameter.",
            "slamb_v1's state includes its int16 staleness counter and its cut permutation (int16 gaps).",
            "Scratch: SLAMB keeps one model-sized buffer (v1: two) between steps instead of allocating its "
            "temporaries afresh each step (on the CPU a fresh model-sized buffer costs more in page faults "
            "than the arithmetic done in it); LAMB and AdamW allocate theirs each step, as torch's foreach "
            "optimizers do, and their peak shows it.",
            "Peak is the process's highest RSS beyond the state after warm-up: slamb_v1's includes the one-time cut of its permutation at the first step (a randperm and a sort of every coordinate), not a per-step cost.",
            "`slamb_v2_nocheck` is `nonfinite=\"ignore\"`: no rank-agreed non-finite check, so no host sync.", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert_base", "resnet110"], choices=sorted(MODELS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for optimizer in args.optimizers:
            rows.append(run_one(model, optimizer, args.steps, args.device))
            r = rows[-1]
            print(f"{model:10s} {optimizer:16s} {r['ms']:9.1f} ms  state {r['state_words']:.2f}  "
                  f"peak {r['peak_words']:.2f} words/param", flush=True)
    out = args.out or f"results/bench/optimizer_step{'' if args.device == 'cpu' else '_' + args.device}.md"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(rows, args.device, args.steps))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
