"""The GPU acceptance check, in two tiers (``make gpu-check``; docs/gpu.md), offline, on one GPU.

    python -m bench.gpu_check --tier 1     # at most 5 minutes on one H100
    python -m bench.gpu_check --tier 2     # the rest, at most 9 minutes

Tier 1 needs torch, triton, pytest, transformers, omegaconf and antlr4 alone, and runs, in this order:

* environment: driver, CUDA, NCCL, torch, triton, the GPU and its MIG state (read, never changed), and a probe of
  the torch APIs the library relies on (:func:`api_probe`);
* bandwidth: the HBM copy bandwidth, and the per-tensor sums of BERT-Large's block layout by the 1-D segment
  reduction the fused step runs against the 2-D one, timed by CUDA events;
* tests: the gpu-marked tests (:data:`TEST_FILES`) but tier 2's, each with a time limit, streamed to the page
  as each ends;
* step: the optimizer step on BERT-Large's shapes in one fresh process with an empty inductor cache: the floor,
  torch's fused AdamW, multi-tensor LAMB, fused LAMB and fused SLAMB v2, each with its first step (a fused row's
  compile), its median step, its kernels and host syncs per step and any compile fallback; the targets, and the
  per-kernel profile of a step that misses one.

Tier 2: the tests of several processes and the integration examples (:data:`TIER2_TESTS`), the peak memory of a
BERT-Large fp16 step, the step rows of BERT-Base and ResNet-110, a fused LAMB step over more than 2^31 entries
(BERT-XL's shapes) against the reference on its last tensors, the fused steps under torch's deterministic mode,
fused LAMB in two fresh processes compared bit for bit, and ``bert.demo`` on CUDA in fp16.

The page (``results/gpu/<gpu>.md``) and its ``.json`` are written after every part and every test, so a run cut
short keeps what it measured; no part starts after the tier's deadline, and the tests stop starting tests when the
parts after them need the rest. A tier's run replaces that tier's parts of an earlier page of the same GPU and keeps
the other tier's, each part with the commit it ran at. Without CUDA it runs the environment part (printed) and
prints a line for each part it skips; nothing is written.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.optimizer_step import measured
from harness.run import git_revision

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "gpu"
FORMAT = 2  # the JSON's layout; a page without it is an earlier check's, rendered as it was (render_v1)
# every gpu-marked test lives in these (tests/test_gpu_check.py checks it)
TEST_FILES = ("tests/test_gpu.py", "tests/test_masks.py")
# the gpu-marked tests of tier 2: several processes each, or a whole example run
TIER2_TESTS = ("test_two_gloo_ranks_on_one_gpu_exchange_as_on_the_cpu",
               "test_overlap_hook_on_cuda_equals_the_plain_exchange",
               "test_integration_example_runs_as_written_on_the_gpu")
TIERS = {1: ("environment", "bandwidth", "tests", "step"),
         2: ("more_tests", "memory", "steps", "bert_xl", "deterministic", "repeatable", "bert_demo")}
# seconds of command time a tier may take (5 and 9 minutes), less what starting Python and writing take
DEADLINE = {1: 285.0, 2: 525.0}
# what the parts after a tier's tests need: the tests stop starting tests that long before the deadline
AFTER_TESTS = {1: 110.0, 2: 330.0}
# how far past the deadline a part that runs in a process of its own may go before it is stopped: the tiers' 5 and 9
# minutes are the deadlines and this, with the start and the writing
OVERRUN = 10.0
TEST_TIMEOUT = 90.0  # seconds per test
STEP_ROWS = ("adamw_fused", "lamb", "lamb_fused", "slamb_v2_fused")  # beside the floor
STEP_STEPS = 10  # timed steps per row
MORE_STEP_ROWS = STEP_ROWS + ("slamb_v2", "slamb_v1_fused")
# the targets of tier 1's step (BERT-Large): a fused step within a factor of its own traffic at the floor's
# bandwidth (fp32 words per parameter), and fused SLAMB v2 against torch's fused AdamW, paired
TRAFFIC_WORDS = {"lamb_fused": 11.0, "slamb_v2_fused": 15.6}
TRAFFIC_LIMIT = {"lamb_fused": 1.25, "slamb_v2_fused": 1.5}
ADAMW_LIMIT = 2.0
MEMORY_ROWS = ("lamb", "slamb_v2")
MICRO_BATCHES = (32, 64)
SEQ = 128
CUDA = torch.device("cuda")
INT32_ENTRIES = 2**31  # a flat buffer longer than this needs 64-bit offsets


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ----------------------------------------------------------------------------- environment


def environment(revision: str | None = None) -> dict:
    """What the results depend on, read only (nvidia-smi is asked, never told); the GPU's where there is one.

    ``revision`` names the commit for a copy of the tree whose ``.git`` does not match it (a device
    machine that receives the working tree beside an older repository)."""
    revision = {"commit": revision, "dirty": False} if revision else git_revision(ROOT)
    env = {"torch": torch.__version__, "triton": _version("triton"), "python": platform.python_version(),
           "revision": revision["commit"][:7], "dirty": bool(revision["dirty"])}
    if not torch.cuda.is_available():
        return env
    props = torch.cuda.get_device_properties(0)
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,mig.mode.current,compute_cap",
                "--format=csv,noheader"]).split(", ")
    keys = ("smi_name", "driver", "memory_total", "mig_mode", "compute_cap")
    env.update(dict(zip(keys, smi)) if len(smi) == len(keys) else {"nvidia_smi": "not available"})
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    env.update(gpu=props.name, sm_count=props.multi_processor_count,
               gpu_memory_gib=round(props.total_memory / 2**30, 1), capability=f"{props.major}.{props.minor}",
               cuda=torch.version.cuda,
               nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
               cudnn=torch.backends.cudnn.version())
    return env


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def api_probe() -> dict:
    """The torch APIs the library relies on, as this torch has them: FSDP2's public hooks and the private state
    :mod:`slamb.ddp` re-points (no public switch exists), DTensor and DeviceMesh, DCP, the collectives'
    names (:mod:`slamb.comm` takes the older where the newer is missing) and inductor's deterministic settings."""
    import inspect

    import torch.distributed as dist

    from slamb.optim.fused import DETERMINISTIC, compile_options

    out = {}
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_state

        for name in ("set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook", "_get_fsdp_state"):
            out[f"FSDPModule.{name}"] = hasattr(FSDPModule, name)
        init = inspect.getsource(_fsdp_state.FSDPState.__init__)
        out["FSDPState parameter groups"] = ("_fsdp_param_groups" if "_fsdp_param_groups" in init
                                             else "_fsdp_param_group" if "_fsdp_param_group" in init else "neither")
        out["FSDPMeshInfo, HSDPMeshInfo"] = all(hasattr(_fsdp_common, n) for n in ("FSDPMeshInfo", "HSDPMeshInfo"))
    except ImportError as e:
        out["FSDP2"] = f"not importable: {e}"
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    out["DeviceMesh.from_group"] = hasattr(DeviceMesh, "from_group")
    params = inspect.signature(DTensor.from_local).parameters
    out["DTensor.from_local(shape=, stride=)"] = "shape" in params and "stride" in params
    import torch.distributed.checkpoint as dcp

    out["dcp.save, dcp.load"] = hasattr(dcp, "save") and hasattr(dcp, "load")
    for name, newer, older in (("all-gather", "all_gather_single", "all_gather_into_tensor"),
                               ("reduce-scatter", "reduce_scatter_single", "reduce_scatter_tensor")):
        out[name] = newer if hasattr(dist, newer) else older
    have = compile_options()
    out["inductor deterministic settings"] = ", ".join(f"{k}={'yes' if k in have else 'missing'}"
                                                       for k in DETERMINISTIC)
    out["torch.cuda.set_sync_debug_mode"] = hasattr(torch.cuda, "set_sync_debug_mode")
    return out


def environment_part(check) -> dict:
    got = {"api": api_probe()}
    for k, v in got["api"].items():
        print(f"gpu-check:   {k}: {v}", flush=True)
    return got


# ----------------------------------------------------------------------------- bandwidth and the segment sums


def cuda_seconds(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` by CUDA events, after two untimed calls."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3)
    return out


def bandwidth_part(check) -> dict:
    """The copy bandwidth of 1 GiB buffers (8 bytes moved per fp32 word), and the per-tensor sums of BERT-Large's
    (blocks, 4) per-block sums: the 1-D reduction against the 2-D one, time and largest relative difference."""
    from bench.shapes import MODELS
    from slamb.optim.fused import BLOCK, tensor_sums

    n = 1 << 28
    src = torch.randn(n, device=CUDA)
    dst = torch.empty_like(src)
    copy = statistics.median(cuda_seconds(lambda: dst.copy_(src), 20))
    del src, dst
    blocks = torch.tensor([math.ceil(math.prod(s) / BLOCK) for s in MODELS["bert_large"]()], device=CUDA)
    per_block = torch.rand(int(blocks.sum()), 4, device=CUDA)
    one = statistics.median(cuda_seconds(lambda: tensor_sums(per_block, blocks), 10))
    two_d = lambda: torch.segment_reduce(per_block.double(), "sum", lengths=blocks, axis=0,  # noqa: E731
                                         unsafe=True).float()
    two = statistics.median(cuda_seconds(two_d, 5))
    a, b = tensor_sums(per_block, blocks), two_d()
    torch.cuda.empty_cache()  # the tests and the steps run in other processes
    return {"copy_gb_per_s": round(8 * n / copy / 1e9, 1), "copy_bytes": 8 * n,
            "segment_blocks": int(blocks.sum()), "segment_tensors": blocks.numel(),
            "segment_1d_ms": round(1e3 * one, 3), "segment_2d_ms": round(1e3 * two, 3),
            "segment_max_rel_diff": float(((a - b).abs() / b.abs()).max())}


# ----------------------------------------------------------------------------- tests


def test_selection(tier: int) -> str:
    """The ``-k`` expression of a tier's gpu-marked tests."""
    names = " or ".join(TIER2_TESTS)
    return f"not ({names})" if tier == 1 else names


def tests_part(check, paths: tuple[str, ...], selection: str, extra: list[str] = ()) -> dict:
    """The gpu-marked tests of ``paths`` that ``selection`` (``-k``) picks, in one pytest process, each under
    :data:`TEST_TIMEOUT`, each result on the page as it comes (:mod:`bench.gpu_tests`); at ``check``'s time for
    the tests the run is ended and the tests it did not reach are listed as not run."""
    got = check.part  # filled as the tests end: the page shows them at once
    with tempfile.TemporaryDirectory() as tmp:
        stream = Path(tmp) / "stream.jsonl"
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "bench.gpu_tests",
               f"--stream={stream}", f"--test-timeout={TEST_TIMEOUT:g}", *paths, "-k", selection, *extra]
        got.update(command=" ".join(["python -m pytest -q -m gpu", *paths, "-k", f'"{selection}"', *extra]), rows=[],
                   collected=0)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        log = open(Path(tmp) / "output.txt", "w+")
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        collected, rows, seen = [], {}, 0
        stopped = False
        while True:
            done = proc.poll() is not None
            lines = stream.read_text().splitlines() if stream.exists() else []
            for line in lines[seen:]:
                record = json.loads(line)
                if "collected" in record:
                    collected = record["collected"]
                    continue
                rows[record["test"]] = record
                print(f"gpu-check:   {record['outcome']:7s} {record['seconds']:7.1f} s  {record['test']}"
                      + (f"  ({record['message']})" if record["outcome"] != "passed" and record["message"] else ""),
                      flush=True)
            if len(lines) > seen:
                seen = len(lines)
                got.update(rows=list(rows.values()), collected=len(collected))
                check.save()
            if done:
                break
            if check.left() <= check.after_tests:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                stopped = True
                break
            time.sleep(1.0)
        log.seek(0)
        tail = log.read().strip().splitlines()[-30:]
        log.close()
    rows = list(rows.values())
    ran = {r["test"] for r in rows}
    rows += [{"test": t, "outcome": "not run", "seconds": 0.0, "message": "the check's time for its tests ran out"}
             for t in collected if t not in ran]
    got.update(rows=rows, collected=len(collected), exit_code=proc.returncode, stopped=stopped,
               tail=tail if proc.returncode else tail[-1:])
    got["failed"] = stopped or proc.returncode not in (0, 5) or any(
        r["outcome"] in ("failed", "error", "not run") for r in rows)
    return got


# ----------------------------------------------------------------------------- optimizer steps


def spawn(check, target, args, env: dict | None = None):
    """``bench.optimizer_step._spawn`` stopped :data:`OVERRUN` seconds past ``check``'s deadline (30 s at the
    least)."""
    from bench import optimizer_step as ostep

    return ostep._spawn(target, args, env or {}, timeout=max(30.0, check.left() + OVERRUN))


def host_syncs(step) -> int:
    """What one call of ``step`` makes the host wait for: ``torch.cuda.set_sync_debug_mode("warn")``'s warnings."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def kernel_profile(step, top: int = 12) -> list[dict]:
    """The device kernels of one call of ``step`` by their total time, the largest ``top``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals: dict[str, tuple[int, float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            calls, us = totals.get(e.name, (0, 0.0))
            totals[e.name] = (calls + 1, us + e.time_range.elapsed_us())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"kernel": name[:100], "calls": calls, "ms": round(us / 1e3, 3)} for name, (calls, us) in ranked]


def step_targets(rows: dict) -> list[dict]:
    """Tier 1's targets from the step rows: each fused step over its own traffic (:data:`TRAFFIC_WORDS`) at the
    floor's bandwidth, fused SLAMB v2 over torch's fused AdamW (paired medians); refused for a row that fell back."""
    from bench.optimizer_step import FLOOR_WORDS

    out = []
    for name, words in TRAFFIC_WORDS.items():
        r = rows.get(name)
        value = None if r is None or r.get("fallback") else r["vs_floor"][1] * FLOOR_WORDS / words
        out.append({"target": f"{name} step / its traffic ({words:g} fp32 words per parameter)", "row": name,
                    "limit": TRAFFIC_LIMIT[name], "value": value})
    r = rows.get("slamb_v2_fused")
    out.append({"target": "slamb_v2_fused step / torch's fused AdamW step", "row": "slamb_v2_fused",
                "limit": ADAMW_LIMIT, "value": None if r is None or r.get("fallback") else r["vs_adamw"][1]})
    for t in out:
        fell = (rows.get(t["row"]) or {}).get("fallback")
        t["verdict"] = ("refused: its compile failed" if fell else "not measured" if t["value"] is None
                        else "met" if t["value"] <= t["limit"] else "missed")
    return out


def _step_rows(model: str, names: list[str], steps: int, profile_missed: bool, queue) -> None:
    """In a fresh process: ``bench.optimizer_step``'s paired run of ``names`` on ``model``'s shapes on CUDA, each
    row with its first step, kernels and host syncs per step and fallback; with ``profile_missed``, the kernel
    profile of each row that misses a target."""
    from bench import optimizer_step as ostep
    from bench.kernels import kernels_per_step
    from bench.shapes import MODELS

    shapes = MODELS[model]()
    numel = sum(math.prod(s) for s in shapes)
    first, built = {}, {}
    times = ostep.measure_times(shapes, names, steps, CUDA.type, first=first, built=built)
    rows = {r["optimizer"]: r for r in ostep.summarize(times, numel, ostep.fallbacks(built))}
    for name, opt in built.items():
        rows[name].update(first_step_s=round(first[name], 2), host_syncs=host_syncs(opt.step),
                          **kernels_per_step(opt.step, CUDA))
    targets = step_targets(rows) if profile_missed else []
    for t in targets:
        if t["verdict"] == "missed":
            rows[t["row"]]["profile"] = kernel_profile(built[t["row"]].step)
    queue.put({"numel": numel, "steps": steps, "rows": list(rows.values()), "targets": targets})


def step_part(check, model: str, names, steps: int = STEP_STEPS, targets: bool = True) -> dict:
    """:func:`_step_rows` in a fresh process with an empty inductor cache, so a fused row's first step is its
    compile."""
    with tempfile.TemporaryDirectory() as cache:
        got = spawn(check, _step_rows, (model, list(names), steps, targets), {"TORCHINDUCTOR_CACHE_DIR": cache})
    got["failed"] = any("fallback" in r for r in got["rows"])
    return got


def steps_part(check) -> dict:
    return {model: step_part(check, model, MORE_STEP_ROWS, targets=False) for model in ("bert_base", "resnet110")}


# ----------------------------------------------------------------------------- tier 2: beyond 2^31, determinism


def _bert_xl_lamb(queue) -> None:
    """Fused LAMB over BERT-XL's shapes (more than 2^31 entries, so offsets past int32), two steps; the tensors
    that start past 2^31 are stepped by the reference path from copies of the same values, and compared."""
    import slamb
    from bench.optimizer_step import _model_params
    from bench.shapes import MODELS
    from slamb.optim.fused import BLOCK

    shapes = MODELS["bert_xl"]()
    offsets, at = [], 0
    for s in shapes:
        offsets.append(at)
        at += math.ceil(math.prod(s) / BLOCK) * BLOCK
    last = [i for i, o in enumerate(offsets) if o >= INT32_ENTRIES]
    params = _model_params(shapes, CUDA)
    copies = [torch.nn.Parameter(params[i].detach().clone()) for i in last]
    for c, i in zip(copies, last):
        c.grad = params[i].grad.clone()
    settings = dict(lr=1e-3, weight_decay=0.01)
    opt, ref = slamb.LAMB(params, fused=True, **settings), slamb.LAMB(copies, foreach=False, **settings)
    tic = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    first = time.perf_counter() - tic
    opt.step()
    for _ in range(2):
        ref.step()
    params, copies = [p.detach() for p in params], [c.detach() for c in copies]
    diff = max(float(((params[i] - c).abs() / c.abs().clamp_min(1e-12)).max()) for i, c in zip(last, copies))
    close = all(torch.allclose(params[i], c, rtol=1e-5, atol=1e-7) for i, c in zip(last, copies))
    queue.put({"numel": sum(p.numel() for p in params), "layout_numel": at, "checked_tensors": len(last),
               "checked_numel": sum(c.numel() for c in copies), "first_step_s": round(first, 2),
               "max_rel_diff": diff, "fallback": opt.fused_fallback,
               "failed": not close or opt.fused_fallback is not None})


def bert_xl_part(check) -> dict:
    return spawn(check, _bert_xl_lamb, ())


def _fused_steps(deterministic: bool, queue) -> None:
    """Fused LAMB, SLAMB v1 and v2 on a small BERT-like model, 3 steps from fixed values, twice each; under
    ``deterministic``, with ``torch.use_deterministic_algorithms(True)``. The parameters' digests, and an error
    where one was raised."""
    from tests.test_gpu import FUSED, bert_like_params, make

    torch.use_deterministic_algorithms(deterministic)
    out = {}
    for row in FUSED:
        try:
            digests = []
            for _ in range(2):
                params = bert_like_params(CUDA)
                opt = make(row, params, fused=True)
                for _ in range(3):
                    opt.step()
                digests.append(digest(params))
            out[row] = {"equal": digests[0] == digests[1], "digest": digests[0], "fallback": opt.fused_fallback}
        except RuntimeError as e:
            out[row] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    queue.put({"rows": out})


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def deterministic_part(check) -> dict:
    got = spawn(check, _fused_steps, (True,))
    got["failed"] = any("error" in r or not r["equal"] or r["fallback"] for r in got["rows"].values())
    return got


def _fused_lamb_digest(queue) -> None:
    import slamb
    from bench.optimizer_step import _model_params
    from bench.shapes import MODELS

    params = _model_params(MODELS["bert_base"](), CUDA)
    opt = slamb.LAMB(params, lr=1e-3, weight_decay=0.01, fused=True)
    for _ in range(3):
        opt.step()
    queue.put({"digest": digest(params), "fallback": opt.fused_fallback})


def repeatable_part(check) -> dict:
    """Fused LAMB on BERT-Base's shapes, 3 steps, in two fresh processes each with an empty inductor cache (each
    compiles its graphs): the parameters bit for bit."""
    runs = []
    for _ in range(2):
        with tempfile.TemporaryDirectory() as cache:
            runs.append(spawn(check, _fused_lamb_digest, (), {"TORCHINDUCTOR_CACHE_DIR": cache}))
    return {"runs": runs, "failed": runs[0]["digest"] != runs[1]["digest"] or any(r["fallback"] for r in runs)}


def bert_demo_part(check) -> dict:
    """``python -m bert.demo`` on one process on CUDA in fp16 (its corpus, vocabulary and shards made first): it
    exits 0 and its summary's final loss is finite."""
    import ast

    args = ["--workers", "1", "--steps", "20", "--vocab-size", "1000", "trainer.precision=fp16", "log_every=10"]
    with tempfile.TemporaryDirectory() as out:
        tic = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "bert.demo", "--out", out, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=max(30.0, check.left() + OVERRUN))
    try:
        loss = float(ast.literal_eval(proc.stdout.strip().splitlines()[-1])["final_loss"])
    except (IndexError, ValueError, SyntaxError, KeyError, TypeError):
        loss = None
    return {"command": " ".join(["python -m bert.demo", *args]), "exit_code": proc.returncode,
            "seconds": round(time.perf_counter() - tic, 1), "final_loss": loss,
            "tail": (proc.stdout + proc.stderr).strip().splitlines()[-15:] if proc.returncode else [],
            "failed": proc.returncode != 0 or loss is None or not math.isfinite(loss)}


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
    model = BertForPreTraining(config).to(CUDA)
    opt = ostep.optimizers()[row]([p for p in model.parameters() if p.requires_grad])
    amp = MixedPrecision("fp16", CUDA, optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 30528, (micro_batch, SEQ), generator=gen).to(CUDA)
    labels = torch.where(torch.rand(ids.shape, generator=gen).to(CUDA) < 0.15, ids, torch.full_like(ids, -100))
    nsp = torch.zeros(micro_batch, dtype=torch.long, device=CUDA)
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


def memory_part(check) -> dict:
    rows = []
    for row in MEMORY_ROWS:
        pred = predicted_gb(row)
        for mb in MICRO_BATCHES:
            got = spawn(check, _peak, (row, mb))
            # one GPU, no DDP: the page's buckets are not allocated here
            weights_and_state = pred["forward/backward"] - pred.get("DDP buckets", 0.0)
            rows.append({"optimizer": row, "micro_batch": mb, "seq": SEQ, **got,
                         "predicted_no_activations_gb": round(weights_and_state, 2)})
            if "activations per sequence" in pred:
                rows[-1]["predicted_gb"] = round(weights_and_state + mb * pred["activations per sequence"], 2)
            if "peak_gb" in got:
                rows[-1]["activations_gb"] = round(got["peak_gb"] - weights_and_state, 2)
    return {"rows": rows, "failed": any("error" in r for r in rows)}


PARTS = {"environment": environment_part, "bandwidth": bandwidth_part,
         "tests": lambda check: tests_part(check, TEST_FILES, test_selection(1), check.pytest_args),
         "step": lambda check: step_part(check, "bert_large", STEP_ROWS),
         "more_tests": lambda check: tests_part(check, TEST_FILES, test_selection(2), check.pytest_args),
         "memory": memory_part, "steps": steps_part, "bert_xl": bert_xl_part, "deterministic": deterministic_part,
         "repeatable": repeatable_part, "bert_demo": bert_demo_part}
CPU_PARTS = ("environment",)  # what runs without CUDA


# ----------------------------------------------------------------------------- the run


class Check:
    """One tier's run: its deadline, the page's results (``res``) and the part that runs (``part``), written
    with :meth:`save` after each part and each test."""

    def __init__(self, tier: int, res: dict, stem: Path | None, deadline: float, pytest_args=(),
                 clock=time.monotonic):
        self.tier, self.res, self.stem, self.clock = tier, res, stem, clock
        self.end = clock() + deadline
        self.after_tests = min(AFTER_TESTS[tier], deadline / 2)
        self.pytest_args = list(pytest_args)
        self.part: dict = {}

    def left(self) -> float:
        return self.end - self.clock()

    def save(self) -> None:
        if self.stem is not None:
            self.stem.with_suffix(".json").write_text(json.dumps(self.res, indent=1, default=str))
            self.stem.with_suffix(".md").write_text(render(self.res))

    def run(self, names, cuda: bool) -> bool:
        """Each part of ``names`` in turn, its results on the page as it ends (and as it goes); True where one
        failed or was not run."""
        env = self.res["environment"]
        failed = False
        for name in names:
            if not cuda and name not in CPU_PARTS:
                print(f"gpu-check: {name} skipped: no CUDA device is visible", flush=True)
                continue
            stamp = {"tier": self.tier, "revision": env["revision"], "dirty": env["dirty"],
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            if self.left() <= 0:
                self.part = self.res["parts"][name] = {**stamp, "status": "not run: the tier's deadline had passed"}
                print(f"gpu-check: {name} not run: the tier's deadline had passed", flush=True)
                failed = True
                self.save()
                continue
            self.part = self.res["parts"][name] = {**stamp, "status": "running"}
            print(f"gpu-check: {name} ...", flush=True)
            tic = self.clock()
            try:
                got = PARTS[name](self)
            except Exception as e:  # a part that breaks is reported on the page; the others still run
                self.part.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
            else:
                self.part.update(got)
                self.part["status"] = "failed" if self.part.pop("failed", False) else "done"
            self.part["seconds"] = round(self.clock() - tic, 1)
            failed |= self.part["status"] != "done"
            print(f"gpu-check: {name} {self.part['status']} in {self.part['seconds']:.0f} s"
                  + (f": {self.part['error']}" if "error" in self.part else ""), flush=True)
            self.save()
        return failed


def load(json_path: Path, env: dict, tier: int) -> dict:
    """The results a tier's run adds to: an earlier run's of the same GPU less this tier's parts (an earlier
    check's layout is left for the new one)."""
    res = json.loads(json_path.read_text()) if json_path.exists() else {}
    if res.get("format") != FORMAT:
        res = {"format": FORMAT, "parts": {}}
    res["parts"] = {k: v for k, v in res["parts"].items() if v.get("tier") != tier}
    res["environment"] = env
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", type=int, choices=sorted(TIERS), default=1)
    parser.add_argument("--only", nargs="+", choices=sorted(PARTS), help="these parts of the tier alone")
    parser.add_argument("--deadline", type=float, help="seconds after which no part starts (default: the tier's)")
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--revision", help="the commit this tree is, where its .git is a stale copy")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[],
                        help="passed to pytest after the tier's selection (last on the command line)")
    args = parser.parse_args(argv)
    names = [n for n in TIERS[args.tier] if not args.only or n in args.only or n == "environment"]
    if args.only and set(args.only) - set(TIERS[args.tier]):
        parser.error(f"invalid --only {' '.join(sorted(set(args.only) - set(TIERS[args.tier])))}: tier "
                     f"{args.tier}'s parts are {', '.join(TIERS[args.tier])}")
    cuda = torch.cuda.is_available()
    env = environment(args.revision)
    print(f"gpu-check: tier {args.tier}; torch {env['torch']}, triton {env['triton']}, "
          + (f"{env['gpu']}, driver {env.get('driver', '?')}" if cuda else "no CUDA device: nothing is written"),
          flush=True)
    stem = None
    if cuda:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / slug(env["gpu"])
    res = load(stem.with_suffix(".json"), env, args.tier) if stem else {"format": FORMAT, "parts": {},
                                                                        "environment": env}
    check = Check(args.tier, res, stem, args.deadline or DEADLINE[args.tier], args.pytest_args)
    failed = check.run(names, cuda)
    if not cuda:
        return 0
    print(f"gpu-check: wrote {stem}.md and .json" + ("; some checks FAILED or did not run" if failed
                                                      else "; every check passed"), flush=True)
    return 1 if failed else 0


# ----------------------------------------------------------------------------- page


def _fmt_q(q) -> str:
    return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})"


def _environment_lines(env: dict) -> list[str]:
    lines = ["## Environment", "", "| | |", "|---|---|"]
    for k in ("gpu", "smi_name", "capability", "sm_count", "gpu_memory_gib", "driver", "cuda", "nccl", "cudnn",
              "torch", "triton", "python", "mig_mode"):
        if k in env:
            lines.append(f"| {k} | {env[k]} |")
    return lines


def _test_lines(tests: dict, title: str) -> list[str]:
    rows = tests["rows"]
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "error", "skipped", "not run")}
    ended = f"exit code {tests['exit_code']}, {tests['seconds']} s" if "exit_code" in tests else "running"
    lines = [title, "", f"`{tests['command']}`: {ended}; " + ", ".join(f"{n} {o}" for o, n in counts.items() if n)
             + ".", ""]
    if "exit_code" not in tests or "collected" in tests:
        lines += ["Each test under a limit of {:g} s; the rows as they ended.".format(TEST_TIMEOUT), ""]
    lines += ["NCCL refuses two ranks on one device, so the two-process tests share the GPU over gloo with "
              "CUDA tensors; NCCL itself is checked in a one-rank group with every collective and dtype the "
              "library sends.", "", "| test | outcome | s | message |", "|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['test']}` | {r['outcome']} | {r['seconds']} | {r['message'].replace('|', '/')} |")
    if tests.get("exit_code") not in (0, None) and not rows:
        lines += ["", "```", *tests["tail"], "```"]
    lines.append("")
    return lines


def _step_lines(model: str, m: dict) -> list[str]:
    floor = next(r for r in m["rows"] if r["optimizer"] == "floor")
    more = any("kernels" in r for r in m["rows"])
    lines = [f"### {model} ({m['numel'] / 1e6:.0f}M parameters, {m['steps']} timed steps; pass bandwidth "
             f"{floor['gb_per_s']:.0f} GB/s)", "",
             "| optimizer | ms | x LAMB | x floor | first step (s) |" + (" kernels | host syncs | fallback |" if more
                                                                          else ""),
             "|---|---:|---:|---:|---:|" + ("---:|---:|---|" if more else "")]
    for r in m["rows"]:
        tail = ("" if not more else " – | – | – |" if "kernels" not in r
                else f" {r['kernels']} | {r['host_syncs']} | {r.get('fallback') or 'none'} |")
        lines.append(f"| {r['optimizer']} | {r['ms']:.2f} | {_fmt_q(r['vs_lamb'])} | {_fmt_q(r['vs_floor'])} "
                     f"| {r.get('first_step_s', '–')} |" + tail)
    lines.append("")
    return lines


STEP_INTRO = ("Median step over the timed steps (parameters and gradients of the model's shapes in fp32, world "
              "size 1), and the quartiles of each step over the LAMB step and over the HBM floor taken in the "
              "same round: the floor is 7 fp32 words per parameter (read p, g, m, v; write p, m, v) at the "
              "bandwidth of an in-place `add_` pass over a flat buffer of the model's size, measured in the "
              "same process. First step: each group of rows runs in a fresh process with an empty inductor "
              "cache, so a fused row's first step includes its compile.")


def _memory_lines(mem: list[dict]) -> list[str]:
    # a run before the page modelled activations has no such prediction: its page keeps its columns
    with_acts = any("predicted_gb" in r for r in mem)
    lines = ["## Peak memory of a BERT-Large fp16 step", "",
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
    return lines


def render_v1(res: dict) -> str:
    """The page of the check before its tiers (its JSON has no ``format``), as that check wrote it."""
    env = res.get("environment", {})
    lines = [f"# GPU check: {env.get('gpu', '?')}", "",
             f"Generated by `make gpu-check` (`python -m bench.gpu_check`) at revision {env.get('revision', '?')}"
             f"{' (with uncommitted changes)' if env.get('dirty') else ''}, {res.get('date', '?')}. "
             "Every figure below was measured on this GPU by that command; nothing is copied from elsewhere.", "",
             *([res["note"], ""] if res.get("note") else []), *_environment_lines(env)]
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
    if res.get("tests"):
        lines += _test_lines(res["tests"], "## Tests (CUDA against the CPU)")
    if res.get("step"):
        lines += ["## Optimizer step", "", STEP_INTRO, ""]
        for model, m in res["step"].items():
            lines += _step_lines(model, m)
    if res.get("memory"):
        lines += _memory_lines(res["memory"])
    return "\n".join(lines)


def render(res: dict) -> str:
    if res.get("format") != FORMAT:
        return render_v1(res)
    env, parts = res.get("environment", {}), res.get("parts", {})
    lines = [f"# GPU check: {env.get('gpu', '?')}", "",
             "Generated by `python -m bench.gpu_check --tier 1` and `--tier 2` (`make gpu-check`; docs/gpu.md). "
             "Every figure below was measured on this GPU by that command; nothing is copied from elsewhere.", "",
             *_environment_lines(env), "",
             "| part | tier | status | s | commit | date |", "|---|---:|---|---:|---|---|"]
    for name, p in parts.items():
        lines.append(f"| {name} | {p['tier']} | {p['status']} | {p.get('seconds', '')} | "
                     f"{p['revision']}{'+' if p['dirty'] else ''} | {p['date']} |")
    lines += ["", "Parts not listed have not run on this GPU. MIG state is read with `nvidia-smi --query-gpu="
              "mig.mode.current`; the check never changes a GPU setting.", ""]
    errors = [(n, p["error"]) for n, p in parts.items() if "error" in p]
    if errors:
        lines += ["## Parts that raised", ""] + [f"- {n}: `{e}`" for n, e in errors] + [""]
    if "api" in parts.get("environment", {}):
        lines += ["## torch APIs the library relies on", "", "| API | here |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in parts["environment"]["api"].items()] + [""]
    b = parts.get("bandwidth", {})
    if "copy_gb_per_s" in b:
        lines += ["## Bandwidth and the per-tensor sums", "",
                  f"Copy of a 1 GiB fp32 buffer into another (CUDA events, median of 20): {b['copy_gb_per_s']} GB/s "
                  "(8 bytes moved per word).", "",
                  f"Per-tensor sums of BERT-Large's per-block sums ({b['segment_blocks']:,} blocks of 256 entries in "
                  f"{b['segment_tensors']} tensors, 4 columns, float64), as the fused step takes them: 1-D segment "
                  f"reduction (the columns one after another) {b['segment_1d_ms']} ms, 2-D {b['segment_2d_ms']} ms; "
                  f"largest relative difference {b['segment_max_rel_diff']:.1e} (the two add in different orders).",
                  ""]
    for name, title in (("tests", "## Tests (CUDA against the CPU), tier 1"),
                        ("more_tests", "## Tests of several processes and the examples, tier 2")):
        if "rows" in parts.get(name, {}):
            lines += _test_lines(parts[name], title)
    if "rows" in parts.get("step", {}):
        step = parts["step"]
        lines += ["## Optimizer step, BERT-Large, tier 1", "", STEP_INTRO + " Kernels: the device kernels of one "
                  "step (`bench.kernels`); host syncs: what `torch.cuda.set_sync_debug_mode` reports in one step; "
                  "fallback: why a fused row's compile failed (its steps then timed the multi-tensor path).", ""]
        lines += _step_lines("bert_large", step)
        lines += ["| target | limit | measured |", "|---|---:|---:|"]
        lines += [f"| {t['target']} | {t['limit']} | {measured(t)} |" for t in step["targets"]]
        lines.append("")
        for r in step["rows"]:
            if "profile" in r:
                lines += [f"Kernels of one {r['optimizer']} step (it misses a target), by device time:", "",
                          "| kernel | calls | ms |", "|---|---:|---:|"]
                lines += [f"| `{k['kernel']}` | {k['calls']} | {k['ms']} |" for k in r["profile"]] + [""]
    if "bert_base" in parts.get("steps", {}):
        lines += ["## Optimizer step, BERT-Base and ResNet-110, tier 2", "", STEP_INTRO, ""]
        for model in ("bert_base", "resnet110"):
            lines += _step_lines(model, parts["steps"][model])
    if "rows" in parts.get("memory", {}):
        lines += _memory_lines(parts["memory"]["rows"])
    x = parts.get("bert_xl", {})
    if "numel" in x:
        lines += ["## Fused LAMB beyond 2^31 entries, tier 2", "",
                  f"BERT-XL's shapes, {x['numel']:,} parameters ({x['layout_numel']:,} entries in the aligned layout), "
                  f"two fused LAMB steps (first {x['first_step_s']} s); the {x['checked_tensors']} tensors that start "
                  f"past 2^31 ({x['checked_numel']:,} entries) against the reference path from the same values: "
                  f"largest relative difference {x['max_rel_diff']:.1e}; fallback: {x['fallback'] or 'none'}.", ""]
    d = parts.get("deterministic", {})
    if "rows" in d:
        lines += ["## Deterministic mode, tier 2", "",
                  "`torch.use_deterministic_algorithms(True)`: each fused optimizer, 3 steps from the same values, "
                  "twice in one process.", "", "| optimizer | result | fallback |", "|---|---|---|"]
        lines += [f"| {row} | {r['error'] if 'error' in r else ('the same bits' if r['equal'] else 'different bits')} "
                  f"| {r.get('fallback') or 'none'} |" for row, r in d["rows"].items()] + [""]
    rep = parts.get("repeatable", {})
    if "runs" in rep:
        same = rep["runs"][0]["digest"] == rep["runs"][1]["digest"]
        lines += ["## Fused LAMB in two fresh processes, tier 2", "",
                  "BERT-Base's shapes, 3 steps, each process with an empty inductor cache: parameters "
                  + ("the same bits" if same else "different bits") + f" (sha256 {rep['runs'][0]['digest']}, "
                  f"{rep['runs'][1]['digest']}).", ""]
    demo = parts.get("bert_demo", {})
    if "exit_code" in demo:
        lines += ["## bert.demo on CUDA in fp16, tier 2", "",
                  f"`{demo['command']}`: exit code {demo['exit_code']}, {demo['seconds']} s, final loss "
                  f"{demo['final_loss']}.", ""]
        if demo["tail"]:
            lines += ["```", *demo["tail"], "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
