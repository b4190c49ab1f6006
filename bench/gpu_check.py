"""The GPU acceptance check: ``make gpu-check`` (``python -m bench.gpu_check``), offline, about 10 minutes
on one H100 or H200.

It writes ``results/gpu/<gpu-name>.md`` and ``.json`` with

* the environment: driver, CUDA, NCCL, torch, the GPU and its MIG state (read, never changed);
* the gpu-marked tests (``tests/test_gpu.py``), each comparing CUDA with the CPU, one row each;
* the optimizer step on BERT-Base and BERT-Large shapes for every multi-tensor and fused optimizer, beside
  torch's fused AdamW and the HBM floor, timed in the same process (``bench.optimizer_step``'s paired
  rotation; the floor is the bandwidth of an in-place pass over a flat fp32 buffer);
* each row's first step: a fresh process and inductor cache per group, so a fused row's is its compile time;
* the peak memory of a BERT-Large fp16 step at micro-batch 32 and 64 (seq 128) beside
  ``results/bench/memory.md``'s prediction, without activations and with its activations per sequence.

Without CUDA it prints one line and exits 0. ``--only`` runs some parts; the page then keeps the other parts
of an earlier run's ``.json`` of the same GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

from harness.run import git_revision

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "gpu"
PARTS = ("tests", "memory", "step")
TEST_FILES = ("tests/test_gpu.py",)  # every gpu-marked test lives here (tests/test_gpu_check.py checks it)
STEP_ROWS = ("lamb", "lamb_fused", "adamw_foreach", "adamw_fused", "slamb_v1", "slamb_v2", "slamb_v1_fused",
             "slamb_v2_fused")
STEP_MODELS = {"bert_base": 20, "bert_large": 10}  # timed steps per optimizer
MEMORY_ROWS = ("lamb", "slamb_v2")
MICRO_BATCHES = (32, 64)
SEQ = 128


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(revision: str | None = None) -> dict:
    """What the results depend on, read only (nvidia-smi is asked, never told).

    ``revision`` names the commit for a copy of the tree whose ``.git`` does not match it (a device
    machine that receives the working tree beside an older repository)."""
    props = torch.cuda.get_device_properties(0)
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,mig.mode.current,compute_cap",
                "--format=csv,noheader"]).split(", ")
    keys = ("smi_name", "driver", "memory_total", "mig_mode", "compute_cap")
    env = dict(zip(keys, smi)) if len(smi) == len(keys) else {"nvidia_smi": "not available"}
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    revision = {"commit": revision, "dirty": False} if revision else git_revision(ROOT)
    env.update(gpu=props.name, sm_count=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1),
               capability=f"{props.major}.{props.minor}", torch=torch.__version__, cuda=torch.version.cuda,
               nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
               cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
               revision=revision["commit"][:7], dirty=bool(revision["dirty"]))
    return env


# ----------------------------------------------------------------------------- tests


def junit_rows(path: Path) -> list[dict]:
    """One row per test case of a junit XML report: its id, outcome, seconds and first message line."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        rows.append({"test": f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}",
                     "outcome": outcome, "seconds": round(float(case.get("time") or 0), 2), "message": message})
    return rows


def run_tests(extra: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={report}",
               *TEST_FILES, *extra]
        tic = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - tic
        rows = junit_rows(report) if report.exists() else []
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
    return {"command": " ".join(["python -m pytest -q -m gpu", *TEST_FILES]), "exit_code": proc.returncode,
            "seconds": round(seconds, 1), "rows": rows, "tail": tail if proc.returncode else tail[-1:]}


# ----------------------------------------------------------------------------- optimizer step


def _times_in_child(model, names, steps, queue) -> None:
    from bench import optimizer_step as ostep
    from bench.shapes import MODELS

    first = {}
    times = ostep.measure_times(MODELS[model](), names, steps, "cuda", first=first)
    queue.put({"times": times, "first": first})


def step_times(model: str, steps: int) -> dict:
    """Paired step times of every row on ``model``'s shapes (in groups that fit the GPU), and each row's first
    step: every group runs in a fresh process with an empty inductor cache, so a fused row's first step is its
    compile time."""
    from bench import optimizer_step as ostep
    from bench.shapes import MODELS

    numel = sum(math.prod(s) for s in MODELS[model]())
    free, _ = torch.cuda.mem_get_info()
    rows, first = {}, {}
    for group in ostep.paired_groups(list(STEP_ROWS), numel, int(0.8 * free)):
        with tempfile.TemporaryDirectory() as cache:
            got = ostep._spawn(_times_in_child, (model, group, steps), {"TORCHINDUCTOR_CACHE_DIR": cache})
        for row in ostep.summarize(got["times"], numel):
            rows.setdefault(row["optimizer"], row)
        for name, seconds in got["first"].items():
            first.setdefault(name, round(seconds, 2))
    for name, row in rows.items():
        if name in first:
            row["first_step_s"] = first[name]
    return {"numel": numel, "steps": steps, "rows": list(rows.values())}


# ----------------------------------------------------------------------------- memory


def predicted_gb(row: str) -> dict:
    """``results/bench/memory.md``'s BERT-Large row: its numeric columns in GB ("forward/backward" is without
    activations), and the page's activations per sequence (key "activations per sequence")."""
    page = (ROOT / "results" / "bench" / "memory.md").read_text()
    section = page.split("## BERT-Large", 1)[1].split("##", 1)[0]
    per_sequence = re.search(r"Activations: ([\d.]+) GB per sequence", section)
    lines = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == row:
            got = {k: float(v) for k, v in zip(head[1:], cells[1:]) if re.fullmatch(r"[\d.]+", v)}
            if per_sequence:
                got["activations per sequence"] = float(per_sequence.group(1))
            return got
    raise KeyError(f"no row {row!r} in results/bench/memory.md's BERT-Large table")


def _peak(row: str, micro_batch: int, queue) -> None:
    """In a fresh process: BERT-Large, fp16 autocast with the rank-agreed loss scale, two steps; the
    allocator's peak (max_memory_allocated) and what it reserved."""
    from bench import optimizer_step as ostep
    from harness.amp import MixedPrecision
    from transformers import BertConfig, BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30528, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2)
    model = BertForPreTraining(config).cuda()
    opt = ostep.optimizers()[row]([p for p in model.parameters() if p.requires_grad])
    amp = MixedPrecision("fp16", torch.device("cuda"), optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30528, (micro_batch, SEQ), generator=gen).cuda()
    labels = torch.where(torch.rand(ids.shape, generator=gen).cuda() < 0.15, ids, torch.full_like(ids, -100))
    nsp = torch.zeros(micro_batch, dtype=torch.long, device="cuda")
    try:
        for _ in range(2):
            opt.zero_grad(set_to_none=False)
            with amp.autocast():
                loss = model(input_ids=ids, labels=labels, next_sentence_label=nsp).loss
            amp.backward(loss)
            amp.step(opt, model.parameters())
        torch.cuda.synchronize()
        queue.put({"peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
                   "reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
                   "params": sum(p.numel() for p in model.parameters()), "loss": round(float(loss.detach()), 3)})
    except torch.OutOfMemoryError as e:
        queue.put({"error": f"out of memory: {str(e).splitlines()[0][:200]}"})


def peak_memory() -> list[dict]:
    from bench import optimizer_step as ostep

    rows = []
    for row in MEMORY_ROWS:
        pred = predicted_gb(row)
        for mb in MICRO_BATCHES:
            got = ostep._spawn(_peak, (row, mb), {})
            # one GPU, no DDP: the page's buckets are not allocated here
            weights_and_state = pred["forward/backward"] - pred.get("DDP buckets", 0.0)
            rows.append({"optimizer": row, "micro_batch": mb, "seq": SEQ, **got,
                         "predicted_no_activations_gb": round(weights_and_state, 2)})
            if "activations per sequence" in pred:
                rows[-1]["predicted_gb"] = round(weights_and_state + mb * pred["activations per sequence"], 2)
            if "peak_gb" in got:
                rows[-1]["activations_gb"] = round(got["peak_gb"] - weights_and_state, 2)
    return rows


# ----------------------------------------------------------------------------- page


def _fmt_q(q) -> str:
    return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})"


def render(res: dict) -> str:
    env = res.get("environment", {})
    lines = [f"# GPU check: {env.get('gpu', '?')}", "",
             f"Generated by `make gpu-check` (`python -m bench.gpu_check`) at revision {env.get('revision', '?')}"
             f"{' (with uncommitted changes)' if env.get('dirty') else ''}, {res.get('date', '?')}. "
             "Every figure below was measured on this GPU by that command; nothing is copied from elsewhere.", "",
             *([res["note"], ""] if res.get("note") else []),
             "## Environment", "", "| | |", "|---|---|"]
    for k in ("gpu", "smi_name", "capability", "sm_count", "gpu_memory_gib", "driver", "cuda", "nccl", "cudnn",
              "torch", "python", "mig_mode"):
        if k in env:
            lines.append(f"| {k} | {env[k]} |")
    measured = res.get("measured", {})
    if measured:
        lines += ["", "Each part's run: " + "; ".join(
            f"{name} at {m['revision']}{'+' if m['dirty'] else ''} ({m['date']})" for name, m in measured.items())
            + ". Parts not listed were not measured."]
    errors = {k[:-len("_error")]: v for k, v in res.items() if k.endswith("_error")}
    if errors:
        lines += ["", "## Parts that failed", ""] + [f"- {part}: `{why}`" for part, why in errors.items()]
    lines += ["", "MIG state is read with `nvidia-smi --query-gpu=mig.mode.current`; the check never changes a GPU "
              "setting.", ""]
    tests = res.get("tests")
    if tests:
        rows = tests["rows"]
        counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "error", "skipped")}
        lines += ["## Tests (CUDA against the CPU)", "",
                  f"`{tests['command']}`: exit code {tests['exit_code']}, {tests['seconds']} s; "
                  + ", ".join(f"{n} {o}" for o, n in counts.items() if n) + ".", "",
                  "NCCL refuses two ranks on one device, so the two-process tests share the GPU over gloo with "
                  "CUDA tensors; NCCL itself is checked in a one-rank group with every collective and dtype the "
                  "library sends.", "", "| test | outcome | s | message |", "|---|---|---:|---|"]
        for r in rows:
            lines.append(f"| `{r['test']}` | {r['outcome']} | {r['seconds']} | {r['message'].replace('|', '/')} |")
        if tests["exit_code"] not in (0,) and not rows:
            lines += ["", "```", *tests["tail"], "```"]
        lines.append("")
    step = res.get("step")
    if step:
        lines += ["## Optimizer step", "",
                  "Median step over the timed steps (parameters and gradients of the model's shapes in fp32, world "
                  "size 1), and the quartiles of each step over the LAMB step and over the HBM floor taken in the "
                  "same round: the floor is 7 fp32 words per parameter (read p, g, m, v; write p, m, v) at the "
                  "bandwidth of an in-place `add_` pass over a flat buffer of the model's size, measured in the "
                  "same process. First step: each group of rows runs in a fresh process with an empty inductor "
                  "cache, so a fused row's first step includes its compile.", ""]
        for model, m in step.items():
            floor = next(r for r in m["rows"] if r["optimizer"] == "floor")
            lines += [f"### {model} ({m['numel'] / 1e6:.0f}M parameters, {m['steps']} timed steps; pass bandwidth "
                      f"{floor['gb_per_s']:.0f} GB/s)", "",
                      "| optimizer | ms | x LAMB | x floor | first step (s) |", "|---|---:|---:|---:|---:|"]
            for r in m["rows"]:
                lines.append(f"| {r['optimizer']} | {r['ms']:.2f} | {_fmt_q(r['vs_lamb'])} | {_fmt_q(r['vs_floor'])} "
                             f"| {r.get('first_step_s', '–')} |")
            lines.append("")
    mem = res.get("memory")
    if mem:
        # a run before the page modelled activations has no such prediction: its page keeps its columns
        with_acts = any("predicted_gb" in r for r in mem)
        lines += ["## Peak memory of a BERT-Large fp16 step", "",
                  f"BERT-Large pre-training model, fp32 master weights, fp16 autocast with the rank-agreed loss scale, "
                  f"sequence {SEQ}, two steps on one GPU (no DDP); `torch.cuda.max_memory_allocated`. The prediction "
                  "is `results/bench/memory.md`'s forward/backward column without its DDP buckets: parameters, "
                  "gradients, state, scratch and autocast's weight copies, activations left out; their difference "
                  "is what the activations took." + (" Predicted with activations: that column plus the page's "
                  "activations per sequence times the micro-batch." if with_acts else ""), "",
                  "| optimizer | micro-batch | measured peak (GB) | reserved (GB) | predicted without activations (GB) "
                  "| activations (GB) |" + (" predicted with activations (GB) |" if with_acts else ""),
                  "|---|---:|---:|---:|---:|---:|" + ("---:|" if with_acts else "")]
        for r in mem:
            tail = f" {r.get('predicted_gb', '')} |" if with_acts else ""
            if "error" in r:
                lines.append(f"| {r['optimizer']} | {r['micro_batch']} | {r['error']} | | "
                             f"{r['predicted_no_activations_gb']} | |" + tail)
            else:
                lines.append(f"| {r['optimizer']} | {r['micro_batch']} | {r['peak_gb']} | {r['reserved_gb']} | "
                             f"{r['predicted_no_activations_gb']} | {r['activations_gb']} |" + tail)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--revision", help="the commit this tree is, where its .git is a stale copy")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to pytest after the test files (last on the command line)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device is visible (torch.cuda.is_available() is False); nothing to check.")
        return 0
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.revision)
    stem = out / slug(env["gpu"])
    json_path = stem.with_suffix(".json")
    res = json.loads(json_path.read_text()) if json_path.exists() else {}
    res.update(environment=env, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    jobs = [("tests", None, lambda: run_tests(args.pytest_args)), ("memory", None, peak_memory),
            *[("step", model, lambda m=model, n=n: step_times(m, n)) for model, n in STEP_MODELS.items()]]
    failed = False
    for part, key, job in jobs:  # each part's results are written as soon as it ends
        if part not in args.only:
            continue
        name = f"{part} {key}" if key else part
        tic = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        try:
            got = job()
        except Exception as e:  # a part that breaks is reported on the page; the others still run
            res[part + "_error"] = f"{type(e).__name__}: {e}"
            failed = True
            print(f"gpu-check: {name} failed: {type(e).__name__}: {e}", flush=True)
        else:
            res.pop(part + "_error", None)
            if key:
                res.setdefault(part, {})[key] = got
            else:
                res[part] = got
            res.setdefault("measured", {})[name] = {"date": res["date"], "revision": env["revision"],
                                                   "dirty": env["dirty"]}
        print(f"gpu-check: {name} took {time.perf_counter() - tic:.0f} s", flush=True)
        json_path.write_text(json.dumps(res, indent=1, default=str))
        stem.with_suffix(".md").write_text(render(res))
    failed |= bool(res.get("tests", {}).get("exit_code"))
    print(f"gpu-check: wrote {stem}.md and .json" + ("; some checks FAILED" if failed else "; every check passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
