"""Step time and memory of one optimizer step, world size 1.

    python -m bench.optimizer_step [--models bert_base resnet110] [--steps N] [--device cpu]

Parameters and gradients of each model's real shapes. Step time: all
optimizers of a model live in one process, each on its own copy of the
parameters, and take their timed steps in turn (in rotated order), after a few
warm-up steps. A shared machine's speed drifts by tens of percent within
minutes, which made separate runs disagree on the ratios; an optimizer's step
and the LAMB step beside it see the same machine, so the table gives the
median of those paired ratios. Memory, from one fresh process per optimizer:

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


# buffers kept between steps only to be reused, at any depth (SLAMB's update buffers and their
# views, the mask policy's float64 buffer)
SCRATCH = ("_work", "_work_views", "_buf")


def _tensors(obj, scratch=False, depth=0, limit=5):
    """(tensor, is scratch) for every tensor reachable from ``obj``."""
    if isinstance(obj, torch.Tensor):
        yield obj, scratch
    elif depth < limit and isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, scratch or k in SCRATCH, depth + 1)
    elif depth < limit and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, scratch, depth + 1)
    elif depth < limit and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Parameter, type)):
        yield from _tensors(vars(obj), scratch, depth + 1)


def state_bytes(opt, params, scratch: bool = False) -> int:
    own = {p.untyped_storage().data_ptr() for p in params}
    seen, total = set(), 0
    internals = {k: v for k, v in vars(opt).items() if k not in ("param_groups", "state")}
    tensors = [t for t, is_scratch in _tensors({"state": dict(opt.state), "internals": internals})
               if is_scratch == scratch]
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or ptr in own or t.device.type == "meta":
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def _model_params(model: str, dev: torch.device) -> list[torch.nn.Parameter]:
    """The model's parameter shapes, filled with the same numbers every time, with gradients."""
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=dev) * 0.02) for s in MODELS[model]()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=dev)
    return params


def _timed_step(opt, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_memory(model: str, optimizer: str, device: str, queue) -> None:
    """Runs in its own process, so that its memory figures are its own."""
    torch.set_num_threads(os.cpu_count() or 1)
    dev = torch.device(device)
    params = _model_params(model, dev)
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
    for _ in range(3):
        _timed_step(opt, cuda)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    queue.put({"numel": numel, "state_words": state_bytes(opt, params) / (4 * numel),
               "scratch_words": state_bytes(opt, params, scratch=True) / (4 * numel),
               "peak_words": max(peak, 0) / (4 * numel)})


def measure_times(model: str, optimizers: list[str], steps: int, device: str, queue) -> None:
    """Every optimizer on its own copy of the parameters in one process, stepped in turn (in rotated order).

    A shared machine's speed drifts by tens of percent within minutes; steps of different optimizers
    taken back to back see the same machine, so their ratio is the figure to trust."""
    torch.set_num_threads(os.cpu_count() or 1)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    opts = {}
    for name in optimizers:
        opts[name] = OPTIMIZERS[name](_model_params(model, dev))
        for _ in range(3):
            opts[name].step()
    times = {name: [] for name in optimizers}
    for i in range(steps):
        k = i % len(optimizers)
        for name in optimizers[k:] + optimizers[:k]:
            times[name].append(_timed_step(opts[name], cuda))
    queue.put(times)


def _spawn(target, args, env: dict):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned child reads its environment (and glibc its malloc tuning) at start
    try:
        proc = ctx.Process(target=target, args=(*args, queue))
        proc.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    result = queue.get()
    proc.join()
    return result


def run_model(model: str, optimizers: list[str], steps: int, device: str) -> list[dict]:
    """Rows of one model: step times from the interleaved run, memory from one process per optimizer."""
    times = _spawn(measure_times, (model, optimizers, steps, device), {})
    # glibc returns blocks above this size to the OS when freed (and maps them afresh: slower, so only here)
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if device == "cpu" else {}
    rows = []
    for name in optimizers:
        mem = _spawn(measure_memory, (model, name, device), env)
        ratios = [t / base for t, base in zip(times[name], times["lamb"])]
        rows.append({"model": model, "optimizer": name, **mem, "ms": 1e3 * statistics.median(times[name]),
                     "vs_lamb": ratios})
    return rows


def render(rows, device: str) -> str:
    steps = ", ".join(f"{r['steps']} ({r['model']})" for r in rows if r["optimizer"] == "lamb")
    out = [
        "# Optimizer step: time and memory (world size 1)",
        "",
        f"Generated by `python -m bench.optimizer_step` on {device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}). "
        f"Step: median of {steps} timed steps per optimizer, after 3 warm-up steps. All optimizers of a model "
        "run in one process, each on its own copy of the parameters, and step in turn, so that each step of an optimizer has a "
        "LAMB step beside it on the same (shared, drifting) machine: vs LAMB is the median of those paired "
        "ratios, with their quartiles. fp32 parameters with the real shapes of each model; memory is measured "
        "with each optimizer in its own process. State and peak are in fp32 words per parameter, beyond the "
        "parameter and its gradient; peak counts the step's temporaries above the resident state.",
        "",
        "| model | parameters | optimizer | step (ms) | vs LAMB | state (words/param) | scratch (words/param) "
        "| peak extra (words/param) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        q1, med, q3 = statistics.quantiles(r["vs_lamb"], n=4)
        out.append(f"| {r['model']} | {r['numel'] / 1e6:.1f}M | {r['optimizer']} | {r['ms']:.1f} | "
                   f"{med:.2f}x ({q1:.2f}-{q3:.2f}) | {r['state_words']:.2f} | {r['scratch_words']:.2f} | "
                   f"{r['peak_words']:.2f} |")
    out += ["", "Targets: SLAMB step <= 1.3x the LAMB step; SLAMB state <= 3 fp32 words per parameter.",
            "slamb_v1's state includes its int16 staleness counter and its cut permutation (int16 gaps).",
            "Scratch: SLAMB keeps one model-sized buffer (v1: two) and its mask policy's k N doubles between "
            "steps instead of allocating its temporaries afresh each step (on the CPU a fresh model-sized "
            "buffer costs more in page faults than the arithmetic done in it); LAMB and AdamW allocate theirs "
            "each step, as torch's foreach optimizers do, and their peak shows it.",
            "Peak is the process's highest RSS beyond the state after warm-up: slamb_v1's includes the one-time cut of its permutation at the first step (a randperm and a sort of every coordinate), not a per-step cost.",
            "`slamb_v2_nocheck` is `nonfinite=\"ignore\"`: no rank-agreed non-finite check, so no host sync.", ""]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert_base", "resnet110"], choices=sorted(MODELS))
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per optimizer (default: 40 for BERT-Base, 200 for smaller models)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    optimizers = list(dict.fromkeys(["lamb", *args.optimizers]))  # every ratio needs a LAMB step beside it
    for model in args.models:
        steps = args.steps or (40 if model == "bert_base" else 200)
        for r in run_model(model, optimizers, steps, args.device):
            rows.append({**r, "steps": steps})
            print(f"{model:10s} {r['optimizer']:16s} {r['ms']:9.1f} ms  {statistics.median(r['vs_lamb']):.2f}x LAMB  "
                  f"state {r['state_words']:.2f}  peak {r['peak_words']:.2f} words/param", flush=True)
    out = args.out or f"results/bench/optimizer_step{'' if args.device == 'cpu' else '_' + args.device}.md"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(render(rows, args.device))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
