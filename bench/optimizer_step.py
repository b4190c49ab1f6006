"""Step time and memory of one optimizer step, world size 1.

    python -m bench.optimizer_step [--models bert_base bert_large resnet110] [--steps N] [--device cpu]
    python -m bench.optimizer_step --quick        # ResNet-110, 10 steps, written to runs/bench/

Parameters and gradients of each model's real shapes. Step time: all
optimizers of a model live in one process, each on its own copy of the
parameters, and take their timed steps in turn (in rotated order), after a few
warm-up steps. A shared machine's speed drifts by tens of percent within
minutes, which made separate runs disagree on the ratios; an optimizer's step
and the LAMB step beside it see the same machine, so the table gives the
median of those paired ratios; likewise each step over torch's fused AdamW
step (``adamw_fused``), which steps beside every row. Beside them, in the same
rotation, an in-place ``add_`` over a flat buffer of the model's size gives the
memory bandwidth, and from it the floor: 7 fp32 words per parameter moved (read
p, g, m, v; write p, m, v). The ``*_fused`` rows take ``fused=True``.
Memory, from one fresh process per optimizer:

* state: bytes of the tensors of the optimizer's ``state_dict()`` (and the
  live state they are views of), in fp32 words per parameter;
* scratch: the other tensors it keeps between steps (SLAMB's update buffers,
  its mask's buffers and the next step's draw, v1's cut permutation);
* peak: the highest memory during the timed steps beyond parameters, gradients,
  state and scratch (CUDA: ``max_memory_allocated``; CPU: peak RSS, reset after the warm-up, in a second
  process where glibc hands every block of 4 KiB or more back, so freed temporaries leave
  the RSS; the step time is measured with glibc's default behaviour);
* kernels: what one step launches (``bench.kernels``): the kernels (a CPU's compiled graph calls and
  computing leaf ops; a GPU's device kernels) and, in brackets, the ops dispatched from the host.

Writes ``results/bench/optimizer_step.md`` (``--quick``: ``runs/bench/``; or ``--out``), with the
measured values of the fused steps' targets beside them.
"""
from __future__ import annotations

import argparse
import queue as queue_module
import importlib.util
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.kernels import kernels_per_step
from bench.memory import Resident, counted_bytes
from bench.shapes import MODELS

ROOT = Path(__file__).resolve().parents[1]
FULL_OUT, SCRATCH_OUT = ROOT / "results" / "bench" / "optimizer_step.md", ROOT / "runs" / "bench" / "optimizer_step.md"

def _slamb(variant: str, **kw):
    return lambda p: __import__("slamb").SLAMB(p, lr=1e-3, weight_decay=0.01, variant=variant, **kw)


def _timm_lamb(p):
    from timm.optim import Lamb

    return Lamb(p, lr=1e-3, weight_decay=0.01)


def optimizers() -> dict:
    """Every row this build can run: timm's LAMB only where timm is installed."""
    import slamb

    rows = {
        "lamb": lambda p: slamb.LAMB(p, lr=1e-3, weight_decay=0.01),
        "lamb_fused": lambda p: slamb.LAMB(p, lr=1e-3, weight_decay=0.01, fused=True),
        "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
        "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
        "timm_lamb": _timm_lamb,
        "slamb_v1": _slamb("v1"),
        "slamb_v2": _slamb("v2"),
        "slamb_v2_nocheck": _slamb("v2", nonfinite="ignore"),
        "slamb_v1_fused": _slamb("v1", fused=True),
        "slamb_v2_fused": _slamb("v2", fused=True),
    }
    if importlib.util.find_spec("timm") is None:
        del rows["timm_lamb"]
    return rows


# The memory-bandwidth floor of an Adam-type step: read p, g, m, v and write p, m, v, in fp32
FLOOR_WORDS = 7
FLOOR = "floor"
# torch's fused AdamW: the step every row is also compared with
ADAMW = "adamw_fused"


def floor_bytes(numel: int) -> int:
    return FLOOR_WORDS * 4 * numel


def floor_seconds(add_seconds: float, numel: int) -> float:
    """The floor's time at the bandwidth of an in-place ``add_`` of a scalar over ``numel`` fp32 words
    (each read once and written once: 8 bytes per word)."""
    return floor_bytes(numel) * add_seconds / (8 * numel)


def _model_params(shapes, dev: torch.device) -> list[torch.nn.Parameter]:
    """Parameters of the given shapes, filled with the same numbers every time, with gradients."""
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=dev) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=dev)
    return params


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        torch.accelerator.synchronize()


def _timed(fn, dev: torch.device) -> float:
    _sync(dev)
    start = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - start


def measure_memory(model: str, optimizer: str, device: str, queue) -> None:
    """Runs in its own process, so that its memory figures are its own."""
    torch.set_num_threads(os.cpu_count() or 1)
    dev = torch.device(device)
    params = _model_params(MODELS[model](), dev)
    numel = sum(p.numel() for p in params)
    opt = optimizers()[optimizer](params)
    for _ in range(3):
        opt.step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # the peak of the timed steps alone: the first steps' one-time work (adopting the parameters into
        # flat buffers, v1's cut of its permutation) is not a step's
        resident = Resident()
        resident.reset()
        base = resident.now()
    for _ in range(3):
        _timed(opt.step, dev)
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resident.peak() - base
    counted = counted_bytes(opt, params)
    launched = kernels_per_step(opt.step, dev)
    queue.put({"state_words": counted["state"] / (4 * numel), "scratch_words": counted["scratch"] / (4 * numel),
               "peak_words": max(peak, 0) / (4 * numel), "kernels": launched["kernels"],
               "host_ops": launched["host_ops"]})


def measure_times(shapes, names: list[str], steps: int, device: str, first: dict | None = None,
                  built: dict | None = None) -> dict[str, list[float]]:
    """Seconds of each timed step of every optimizer in ``names``, each on its own copy of parameters of
    ``shapes``, stepped in turn (in rotated order) after 3 warm-up steps; under ``FLOOR``, an in-place
    ``add_`` of a scalar over a flat fp32 buffer of the same size, timed in the same rotation.

    A shared machine's speed drifts by tens of percent within minutes; steps of different optimizers
    taken back to back see the same machine, so their ratio is the figure to trust. ``first``, when given,
    receives each optimizer's first step in seconds (the fused rows' compile included), ``built`` each optimizer
    (what it did is read from it after: :func:`fallbacks`)."""
    dev = torch.device(device)
    build = optimizers()
    numel = sum(math.prod(s) for s in shapes)
    flat = torch.zeros(numel, device=dev)
    work = {FLOOR: lambda: flat.add_(1.0)}
    for name in names:
        opt = build[name](_model_params(shapes, dev))
        if built is not None:
            built[name] = opt
        seconds = _timed(opt.step, dev)
        if first is not None:
            first[name] = seconds
        for _ in range(2):
            opt.step()
        work[name] = opt.step
    order = list(work)
    times = {name: [] for name in order}
    for i in range(steps):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(_timed(work[name], dev))
    return times


def fallbacks(built: dict) -> dict[str, str]:
    """Each fused optimizer of ``built`` (name -> optimizer) whose compile failed: why (``fused_fallback``). Its
    steps were the multi-tensor path's."""
    return {name: opt.fused_fallback for name, opt in built.items() if getattr(opt, "fused_fallback", None)}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, med, q3 = statistics.quantiles(values, n=4)
    return q1, statistics.median(values), q3


def summarize(times: dict[str, list[float]], numel: int, fell_back: dict | None = None) -> list[dict]:
    """Rows from paired timings: each optimizer's median step, and the quartiles of its step over the
    LAMB step and over the floor (``floor_seconds`` of the ``add_`` pass) taken in the same round; the
    floor's own row first. A row in ``fell_back`` (:func:`fallbacks`) carries why under ``fallback``."""
    floor = [floor_seconds(t, numel) for t in times[FLOOR]]
    series = {FLOOR: floor, **{k: v for k, v in times.items() if k != FLOOR}}
    rows = []
    for name, ts in series.items():
        rows.append({"optimizer": name, "numel": numel, "ms": 1e3 * statistics.median(ts),
                     "vs_lamb": _quartiles([t / b for t, b in zip(ts, times["lamb"])]),
                     "vs_floor": _quartiles([t / f for t, f in zip(ts, floor)]),
                     "vs_adamw": _quartiles([t / b for t, b in zip(ts, times[ADAMW])]) if ADAMW in times else None,
                     "paired": {other: _quartiles([t / b for t, b in zip(ts, times[other])])
                                for other in ("lamb_fused",) if other in times and other != name}})
        if fell_back and name in fell_back:
            rows[-1]["fallback"] = fell_back[name]
    rows[0].update(bytes=floor_bytes(numel), gb_per_s=8 * numel / statistics.median(times[FLOOR]) / 1e9)
    return rows


def _times_in_child(model, names, steps, device, queue) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    built = {}
    times = measure_times(MODELS[model](), names, steps, device, built=built)
    queue.put({"times": times, "fallbacks": fallbacks(built)})


def _spawn(target, args, env: dict, timeout: float | None = None):
    """``target(*args, queue)`` in a fresh process with ``env`` added to its environment: what it puts on the queue.
    ``timeout``: seconds after which the process is killed and ``TimeoutError`` raised."""
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
    start = time.perf_counter()
    while True:  # a child killed (for memory, say) puts nothing: fail instead of waiting for ever
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if timeout is not None and time.perf_counter() - start > timeout:
                proc.kill()
                proc.join()
                raise TimeoutError(f"{target.__name__} did not end in {timeout:.0f} s; stopped") from None
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__}{args} ended with exit code {proc.exitcode} and no result "
                                   "(a negative code is the signal that killed it: -9, out of memory?)") from None
    proc.join()
    return result


# each optimizer in the paired run holds its own parameters, gradients, state and scratch: at most this
# many fp32 words per parameter
WORDS_PER_ROW = 8
# rows that every group of a paired run holds, so that each row is timed beside the ones it is compared with
ANCHORS = ("lamb", "lamb_fused", ADAMW)


def paired_groups(names: list[str], numel: int, available_bytes: int) -> list[list[str]]:
    """``names`` cut into groups that fit ``available_bytes`` together, each group with the anchors it is
    compared against (LAMB and torch's fused AdamW; fused LAMB for fused rows), so that every ratio stays a
    paired one."""
    per_group = max(2, available_bytes // (WORDS_PER_ROW * 4 * numel))
    groups = []
    for fused in (False, True):
        anchors = [a for a in ANCHORS if a in names and (fused or a != "lamb_fused")]
        rest = [n for n in names if n not in ANCHORS and n.endswith("_fused") == fused]
        if fused and "lamb_fused" in names and not rest:
            rest = ["lamb_fused"]  # fused LAMB alone still gets its own row
            anchors.remove("lamb_fused")
        size = max(1, per_group - len(anchors))
        groups += [anchors + rest[i:i + size] for i in range(0, len(rest), size)]
    return groups or [[n for n in names]]


def _available_bytes(device: str) -> int:
    """What the machine can give the paired run: on the CPU 70% of MemAvailable (the rest for the OS and the
    parent); an accelerator's groups are not cut."""
    if device != "cpu":
        return 1 << 62
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(0.7 * int(info["MemAvailable"].split()[0]) * 1024)


def unfit(model: str, names: list[str], available_bytes: int) -> str | None:
    """Why ``model``'s paired run cannot fit ``available_bytes`` (its largest group, the anchors and one row at
    ``WORDS_PER_ROW`` words per parameter each, included), or None where it fits."""
    numel = sum(math.prod(s) for s in MODELS[model]())
    need = max(len(g) for g in paired_groups(names, numel, available_bytes)) * WORDS_PER_ROW * 4 * numel
    if need <= available_bytes:
        return None
    return (f"{model}'s paired run needs {need / 1e9:.1f} GB ({WORDS_PER_ROW} fp32 words per parameter for each "
            f"optimizer stepping together) and this machine has {available_bytes / 1e9:.1f} GB to give")


def run_model(model: str, names: list[str], steps: int, device: str) -> list[dict]:
    """Rows of one model: step times from the interleaved run, memory from one process per optimizer."""
    numel = sum(math.prod(s) for s in MODELS[model]())
    summary = {}  # each row from the first group that timed it
    for group in paired_groups(names, numel, _available_bytes(device)):
        got = _spawn(_times_in_child, (model, group, steps, device), {})
        for row in summarize(got["times"], numel, got["fallbacks"]):
            summary.setdefault(row["optimizer"], row)
    # glibc returns blocks above this size to the OS when freed (and maps them afresh: slower, so only here):
    # 4 KiB, so that a step's temporaries of small tensors (ResNet-110's) leave the RSS too, rather than being
    # reused from a heap that the warm-up steps grew
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 12)} if device == "cpu" else {}
    rows = []
    for row in summary.values():
        mem = {} if row["optimizer"] == FLOOR else _spawn(measure_memory, (model, row["optimizer"], device), env)
        rows.append({"model": model, "steps": steps, **row, **mem})
    return rows


# The targets of the fused steps, checked against the measured rows: (models, what, row, measured value, limit);
# models: those the target is set for (None: every model). The floors are set for BERT's large tensors
# (BERT-Large's is run on a GPU, against its HBM), torch's fused AdamW for ResNet-110's many small ones.
TARGETS = (
    (("bert_base",), "fused SLAMB v2 step / floor", "slamb_v2_fused", lambda r: r["vs_floor"][1], 2.5),
    (("bert_base",), "fused SLAMB v1 step / floor", "slamb_v1_fused", lambda r: r["vs_floor"][1], 2.5),
    (("bert_large",), "fused SLAMB v2 step / floor", "slamb_v2_fused", lambda r: r["vs_floor"][1], 3.0),
    (("bert_large",), "fused SLAMB v1 step / floor", "slamb_v1_fused", lambda r: r["vs_floor"][1], 3.0),
    (("bert_base",), "fused LAMB step / floor", "lamb_fused", lambda r: r["vs_floor"][1], 1.5),
    (("bert_base",), "fused SLAMB v2 step / fused LAMB step", "slamb_v2_fused",
     lambda r: r["paired"]["lamb_fused"][1], 1.3),
    (("bert_base",), "fused SLAMB v1 step / fused LAMB step", "slamb_v1_fused",
     lambda r: r["paired"]["lamb_fused"][1], 1.3),
    (("resnet110",), "fused SLAMB v2 step / torch fused AdamW step", "slamb_v2_fused", lambda r: r["vs_adamw"][1], 2.0),
    (None, "fused SLAMB v2 state (words/param)", "slamb_v2_fused", lambda r: r["state_words"], 2.5),
    (None, "fused SLAMB v1 state (words/param)", "slamb_v1_fused", lambda r: r["state_words"], 2.5),
)


def targets(rows) -> list[dict]:
    """Each target per model it is set for: the measured value and met / missed, or not measured where this
    build has no such row."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        have = {r["optimizer"]: r for r in rows if r["model"] == model}
        for models, what, name, value, limit in TARGETS:
            if models is not None and model not in models:
                continue
            fell = {n for n, r in have.items() if "fallback" in r}  # their steps were the multi-tensor path's
            if name in fell or "lamb_fused" in fell and what.endswith("/ fused LAMB step"):
                out.append({"model": model, "target": what, "limit": limit, "value": None,
                            "verdict": "refused: its compile failed"})
                continue
            try:
                v = value(have[name])
            except KeyError:
                out.append({"model": model, "target": what, "limit": limit, "value": None, "verdict": "not measured"})
                continue
            out.append({"model": model, "target": what, "limit": limit, "value": v,
                        "verdict": "met" if v <= limit else "missed"})
    return out


def measured(t: dict, fmt: str = ".2f") -> str:
    """A target's measured value as a page shows it: the value, or why there is none."""
    if t["value"] is not None:
        return format(t["value"], fmt)
    return "– (its compile failed)" if t["verdict"].startswith("refused") else "–"


def _q(q) -> str:
    return f"{q[1]:.2f}x ({q[0]:.2f}-{q[2]:.2f})"


def render(rows, device: str) -> str:
    steps = ", ".join(f"{r['steps']} ({r['model']})" for r in rows if r["optimizer"] == "lamb")
    floor = {r["model"]: r for r in rows if r["optimizer"] == FLOOR}
    out = [
        "# Optimizer step: time and memory (world size 1)",
        "",
        f"Generated by `python -m bench.optimizer_step` on {device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}). "
        f"Step: median of {steps} timed steps per optimizer, after 3 warm-up steps. All optimizers of a model "
        "run in one process, each on its own copy of the parameters, and step in turn, so that each step of "
        "an optimizer has a LAMB step and a floor pass beside it on the same (shared, drifting) machine: "
        "vs LAMB and vs floor are the medians of those paired ratios, with their quartiles. fp32 parameters "
        "with the real shapes of each model; memory is measured with each optimizer in its own process. "
        "State and peak are in fp32 words per parameter, beyond the parameter and its gradient; peak counts "
        "the step's temporaries above the resident state.",
        "",
        f"Floor: the memory traffic an Adam-type step cannot avoid, {FLOOR_WORDS} fp32 words per parameter "
        "(read p, g, m, v; write p, m, v), at the bandwidth of an in-place `add_` of a scalar over a flat "
        "fp32 buffer of the model's size (8 bytes per word), timed in the same rotation: "
        + "; ".join(f"{m} {r['bytes'] / 1e9:.2f} GB at {r['gb_per_s']:.1f} GB/s" for m, r in floor.items()) + ".",
        "",
        "| model | parameters | optimizer | step (ms) | vs LAMB | vs floor | vs fused AdamW | state (words/param) "
        "| scratch (words/param) | peak extra (words/param) | kernels (host ops) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mem = (["-"] * 4 if r["optimizer"] == FLOOR
               else [f"{r[k]:.2f}" for k in ("state_words", "scratch_words", "peak_words")]
               + [f"{r['kernels']} ({r['host_ops']})"])
        name = r["optimizer"] + (" (fell back)" if "fallback" in r else "")
        out.append(f"| {r['model']} | {r['numel'] / 1e6:.1f}M | {name} | {r['ms']:.1f} | "
                   f"{_q(r['vs_lamb'])} | {_q(r['vs_floor'])} | {_q(r['vs_adamw']) if r['vs_adamw'] else '-'} | "
                   f"{' | '.join(mem)} |")
    fell = [r for r in rows if "fallback" in r]
    if fell:
        out += ["", "Fell back: `torch.compile` failed for these fused rows, so their steps timed the multi-tensor "
                "path and no figure of theirs is the fused step's: "
                + "; ".join(f"{r['model']} {r['optimizer']}: `{r['fallback']}`" for r in fell) + "."]
    out += ["", "## Targets", "", "Computed from the rows above (medians of the paired ratios).", "",
            "| model | target | limit | measured |", "|---|---|---:|---:|"]
    for t in targets(rows):
        # a state's words to 5 places: the aligned layout's padding is a few in 100,000 on BERT's tensors
        value = measured(t, ".5f" if "state" in t["target"] else ".2f")
        out.append(f"| {t['model']} | {t['target']} | {t['limit']} | {value} |")
    out += ["",
            "Rows: `lamb`, `slamb_*` are this package's (`*_fused`: `fused=True`); `adamw_foreach` / `adamw_fused` are torch's AdamW; `timm_lamb` is timm's "
            "`Lamb` (with its default global gradient-norm clipping). `adamw_fused` steps beside every row: vs fused "
            "AdamW is the median of those paired ratios.",
            "State: the tensors of `state_dict()` (and the live state they are views of); slamb_v1's includes "
            "its int16 staleness counter. Scratch: the other tensors an optimizer keeps between steps (counted "
            "as `bench.memory` counts them): SLAMB's update buffers, its mask's buffers and next draw, v1's cut "
            "permutation (int16 gaps), kept instead of allocating the temporaries afresh each step; LAMB and "
            "AdamW allocate theirs each step, as torch's foreach optimizers do, and their peak shows it.",
            "Peak is the highest memory during the timed steps beyond what was resident before them (CPU: the "
            "RSS high-water mark, reset after the warm-up steps), so a first step's one-time work (the fused "
            "paths' adoption of the parameters into flat buffers, slamb_v1's cut of its permutation) is not in it.",
            "`slamb_v2_nocheck` is `nonfinite=\"ignore\"`: no rank-agreed non-finite check, so no host sync.",
            "Kernels: one step's launches from `torch.profiler` (`bench.kernels`): on a CPU the compiled graph "
            "calls and the eager ops that compute (a foreach op once per tensor it loops over), on a GPU the "
            "device kernels; in brackets the ops dispatched from the host (a foreach op once) and graph calls.", ""]
    return "\n".join(out)


def main(argv=None) -> None:
    rows_here = optimizers()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS))
    parser.add_argument("--optimizers", nargs="+", default=list(rows_here), choices=list(rows_here))
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per optimizer (default: 40 for the BERT models, 200 for smaller ones)")
    parser.add_argument("--device", default=torch.accelerator.current_accelerator().type
                        if torch.accelerator.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="ResNet-110 only, 10 steps; written to runs/bench/ unless --out is given")
    parser.add_argument("--out", default=None,
                        help="the page to write (default: results/bench/optimizer_step[_<device>].md; "
                             "runs/bench/ for --quick)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"invalid --steps={args.steps}: must be >= 1")
    names = list(dict.fromkeys(["lamb", ADAMW, *args.optimizers]))  # every ratio needs its LAMB and AdamW steps
    models = args.models or (["resnet110"] if args.quick else ["bert_base", "bert_large", "resnet110"])
    available = _available_bytes(args.device)
    for model in list(models):
        why = unfit(model, names, available)
        if why and args.models:
            parser.error(f"invalid --models {model}: {why}; leave it out, or run on a device with the memory")
        if why:
            print(f"skipping {model}: {why}", flush=True)
            models.remove(model)
    rows = []
    for model in models:
        steps = args.steps or (10 if args.quick else 40 if model.startswith("bert") else 200)
        for r in run_model(model, names, steps, args.device):
            rows.append(r)
            print(f"{model:10s} {r['optimizer']:16s} {r['ms']:9.1f} ms  {r['vs_lamb'][1]:.2f}x LAMB  "
                  f"{r['vs_floor'][1]:.2f}x floor  {r['vs_adamw'][1]:.2f}x AdamW", flush=True)
    suffix = "" if args.device == "cpu" else "_" + args.device
    out = Path(args.out) if args.out else (SCRATCH_OUT if args.quick else FULL_OUT).with_stem(f"optimizer_step{suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rows, args.device))
    print(f"wrote {out}")
    fell = [f"{r['model']} {r['optimizer']}" for r in rows if "fallback" in r]
    if fell:
        raise SystemExit(f"torch.compile failed for {', '.join(fell)}: their steps timed the multi-tensor path "
                         f"(the page says so)")


if __name__ == "__main__":
    main()
