"""BERT pre-training: model shapes, the schedules, gradient accumulation, the rank-agreed fp16 loss
scaler, and 2-worker runs of LAMB, 1-bit LAMB and SLAMB (loss, accuracies, bytes), phase 2 from phase 1,
and exact auto-resume."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import h5py
import pytest
import torch
from omegaconf import OmegaConf

from bert import prepare_data as prep
from bert.data import IGNORE_INDEX, PretrainingStream, find_shards
from bert.model import build_model, parameter_count
from bert.tiny import write_tiny
from bert.train import initial_model, train
from harness.accumulate import accumulation_steps
from harness.amp import MixedPrecision, accumulation_context
from harness.schedules import build_lr_scheduler
from slamb.schedules import WarmupExpDecay
from tests import distributed

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SEQ1, SEQ2 = 32, 64


def compose_bert(*overrides) -> dict:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return OmegaConf.to_container(compose("bert", overrides=list(overrides)), resolve=True)


# ------------------------------------------------------------------------------------------ models


def meta_model(name: str):
    cfg = compose_bert(f"model={name}")["model"]
    with torch.device("meta"):
        return build_model(cfg)


def test_bert_large_and_xl_have_the_documented_sizes():
    large, xl = meta_model("bert_large"), meta_model("bert_xl")
    assert parameter_count(large) == 336_232_258  # BERT-Large, vocabulary 30,528, MLM + NSP heads
    assert parameter_count(xl) == 2_767_626_050    # our 2.8B BERT-XL shape (configs/model/bert_xl.yaml)
    c = large.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (24, 1024, 16, 4096)
    # the MLM decoder is tied to the word embeddings (counted once)
    assert large.cls.predictions.decoder.weight is large.bert.embeddings.word_embeddings.weight


def test_model_config_errors_are_clear():
    cfg = compose_bert("model=bert_tiny", "model.num_attention_heads=3")["model"]
    with pytest.raises(ValueError, match="hidden_size=32 is not a multiple of num_attention_heads=3"):
        build_model(cfg)


# ------------------------------------------------------------------------------------------ schedules


def test_exp_warmup_exp_decay_matches_deepspeeds_formula():
    total, proportion, rate, decay_steps = 7500, 0.06, 0.9, 250
    sched = WarmupExpDecay(int(proportion * total), rate, decay_steps, degree=2.0)

    def deepspeed(step):  # DeepSpeedExamples bing_bert warmup_exp_decay_exp
        x, warmup_end = step / total, proportion * total
        return (x / proportion) ** 2.0 if x < proportion else rate ** ((step - warmup_end) / decay_steps)

    for step in (0, 1, 100, 449, 450, 451, 1000, 7038):
        assert sched(step) == pytest.approx(deepspeed(step), rel=1e-12)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=11e-3)
    lr = build_lr_scheduler(opt, {"name": "warmup_exp", "warmup_fraction": 0.06, "decay_rate": 0.9,
                                  "decay_steps": 250}, 1, 7500)
    for _ in range(700):
        opt.step()
        lr.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(11e-3 * 0.9 ** (250 / 250))
    with pytest.raises(ValueError, match="schedule.decay_rate"):
        WarmupExpDecay(10, 1.5, 100)


def test_ee_row_is_deepspeeds_onebit_lamb_schedule_with_its_offset():
    """DeepSpeedExamples bing_bert's 1-bit LAMB seq-128 run: bert_large_lamb.json (LR 11e-3, warmup_proportion
    0.06, decay_rate 0.9, decay_step 250, total_training_steps 7500) under ``--lr_schedule EE --lr_offset 10e-4``:
    lr = 11e-3 * warmup_exp_decay_exp(step, ...) + 1e-3."""
    cfg = compose_bert("experiment=bert/phase1_onebit_lamb_ee")
    assert cfg["steps"] == 7500 and cfg["optimizer"]["lr"] == 11e-3

    def deepspeed(step):
        x, warmup, total = step / 7500, 0.06, 7500
        return 11e-3 * ((x / warmup) ** 2.0 if x < warmup else 0.9 ** ((step - warmup * total) / 250)) + 10e-4

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=cfg["optimizer"]["lr"])
    sched = build_lr_scheduler(opt, cfg["schedule"], 1, cfg["steps"])
    for step in (0, 1, 225, 449, 450, 451, 1000, 7038, 7499):
        assert 11e-3 * sched.lr_lambdas[0](step) == pytest.approx(deepspeed(step), rel=1e-12)
    for _ in range(3):  # as stepped: the offset from the first step on
        assert opt.param_groups[0]["lr"] == pytest.approx(deepspeed(sched.last_epoch), rel=1e-12)
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match=r"invalid schedule.lr_offset=-0.001: must be a number in \[0.0, inf\)"):
        build_lr_scheduler(opt, {**cfg["schedule"], "lr_offset": -1e-3}, 1, 7500)


def test_lamb_rows_clip_the_gradients_at_one_as_the_reference_configs_do():
    """NVIDIA's FusedLAMB (max_grad_norm 1.0) and DeepSpeed's LAMB and 1-bit LAMB configs (gradient_clipping 1.0)
    clip the global gradient norm at 1.0; the SLAMB rows do not (docs/recipes.md)."""
    for row in ("phase1_lamb", "phase1_onebit_lamb", "phase1_onebit_lamb_ee", "phase2_lamb", "phase2_onebit_lamb",
                "phase1_xl_hsdp_lamb"):
        assert compose_bert(f"experiment=bert/{row}")["clip_grad"] == 1.0, row
    for row in ("phase1_slamb", "phase2_slamb", "phase1_xl_hsdp_slamb"):
        assert compose_bert(f"experiment=bert/{row}")["clip_grad"] is None, row


def test_nvidia_phase_schedules():
    p = torch.nn.Parameter(torch.zeros(1))
    for phase, steps, lr, warmup in (("phase1_lamb", 7038, 6e-3, 2000), ("phase2_lamb", 1563, 4e-3, 201)):
        cfg = compose_bert(f"experiment=bert/{phase}")
        assert cfg["steps"] == steps and cfg["optimizer"]["lr"] == lr
        opt = torch.optim.SGD([p], lr=lr)
        sched = build_lr_scheduler(opt, cfg["schedule"], 1, steps)
        mult = sched.lr_lambdas[0]
        assert mult(warmup - 1) == 1.0 and mult(99) == pytest.approx(100 / warmup)  # ceil(0.128 * 1563) = 201
        mid = warmup + (steps - warmup) // 2
        assert mult(mid) == pytest.approx((1 - (mid - warmup) / (steps - warmup)) ** 0.5)


def test_paper_rows_hold_the_recipes_settings():
    slamb_row = compose_bert("experiment=bert/phase1_slamb")
    assert slamb_row["data"]["global_batch"] == 65536 and slamb_row["data"]["seq_len"] == 128
    o = slamb_row["optimizer"]
    assert (o["variant"], o["betas"], o["beta3"], o["compress_ratio"], o["sync_interval"], o["comm_dtype"]) == \
        ("v2", [0.9, 0.999], 0.93, 0.1, 100, "float16")
    one = compose_bert("experiment=bert/phase1_onebit_lamb")["optimizer"]
    assert (one["freeze_step"], one["min_coeff"], one["max_coeff"], one["weight_decay"]) == (1000, 0.01, 0.3, 0.01)
    assert compose_bert("experiment=bert/phase2_onebit_lamb")["optimizer"]["freeze_step"] == 7038 + 100
    p2 = compose_bert("experiment=bert/phase2_slamb")
    assert (p2["data"]["global_batch"], p2["data"]["seq_len"], p2["init_from"]) == \
        (32768, 512, "runs/bert_phase1_slamb/model")
    assert compose_bert("experiment=bert/phase1_lamb")["optimizer"]["weight_decay"] == 0.01


# ------------------------------------------------------------------------------ accumulation, fp16


def test_accumulation_steps_fill_the_global_batch_or_explain():
    assert accumulation_steps(65536, 64, 128) == 8
    assert accumulation_steps(32768, 16, 8) == 256
    with pytest.raises(ValueError, match="not a multiple of data.micro_batch=24 x 8 workers"):
        accumulation_steps(65536, 24, 8)
    with pytest.raises(ValueError, match="data.micro_batch"):
        accumulation_steps(64, 0, 1)


def _accumulated_grad(rank, world):
    """DDP gradient of 2 micro-batches with accumulation_context vs the gradient of the whole batch, and bytes sent."""
    import slamb

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = slamb.create_optimizer("lamb", model)
    ddp = slamb.wrap_model(model, opt)
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(rank))  # this rank's 2 micro-batches
    for m in range(2):
        with accumulation_context(ddp, last_micro_batch=m == 1):
            (ddp(x[m]).square().mean() / 2).backward()
    sent = opt.ledger.current["grads"].payload if "grads" in opt.ledger.current else 0
    return [p.grad.clone() for p in model.parameters()], x, sent


@pytest.fixture(scope="module")
def harness(job):
    return [r["harness"][0] for r in job], [r["harness"][1] for r in job]


@pytest.mark.multiprocess
def test_accumulation_communicates_the_accumulated_gradient_once(harness):
    results = harness[0]
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 3)
    xs = torch.cat([x.reshape(-1, 6) for _, x, _ in results])
    ref(xs).square().mean().backward()
    for grads, _, sent in results:
        for g, r in zip(grads, ref.parameters()):
            assert torch.allclose(g, r.grad, atol=1e-6)
        assert sent == sum(p.numel() * 4 for p in ref.parameters())  # one fp32 all-reduce, not two


def _scaler_steps(rank, world):
    import slamb

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = slamb.create_optimizer("slamb", model, lr=0.1)
    amp = MixedPrecision("fp16", torch.device("cpu"), init_scale=1024.0, growth_interval=2)
    out = []
    for step in range(4):
        opt.zero_grad()
        with amp.autocast():
            loss = model(torch.ones(2, 4)).float().sum()
        amp.backward(loss)
        if step == 1 and rank == 1:
            model.weight.grad[0, 0] = math.inf  # only rank 1 overflows
        before = model.weight.detach().clone()
        skipped, _ = amp.step(opt, model.parameters())
        out.append((not skipped, amp.scale, bool(torch.equal(before, model.weight.detach())),
                    opt.ledger.steps, opt.ledger.last_step["control"].payload))
    return out, amp.state_dict()


@pytest.mark.multiprocess
def test_fp16_skips_an_overflow_on_every_rank_together_under_slamb(harness):
    (a, sa), (b, sb) = harness[1]
    assert a == b  # the same decision, scale and ledger on both ranks
    assert [s[0] for s in a] == [True, False, True, True]
    assert [s[1] for s in a] == [1024.0, 512.0, 512.0, 1024.0]  # halved on overflow; doubled after 2 clean steps
    assert [s[2] for s in a] == [False, True, False, False]      # a skipped step leaves the weights alone
    assert [s[3] for s in a] == [1, 2, 3, 4]                     # the ledger closes skipped steps too
    # the scaler's agreement is one float32 a step (on a skipped step the only traffic); SLAMB adds its own
    assert a[1][4] == 4 and all(s[4] > 4 for i, s in enumerate(a) if i != 1)
    assert sa == sb and sa["scale"] == 1024.0 and sa["skipped_steps"] == 1


# ---------------------------------------------------------------------------------- end to end

# "A repeated batch": two identical shards of 8 examples, one per worker, so every step of every worker
# sees the same 8 examples (global batch 16 = 2 workers x 2 micro-batches of 4). Workers with identical
# gradients are the large-batch regime; on tiny per-worker batches whose gradients disagree, SLAMB's
# averaged momentum over a local second moment is unbounded where one worker's gradient is ~0 (zero-init
# biases then take steps of lr x that ratio), which is not what this pipeline test is about.
N_EXAMPLES = 8


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bert_pretrain")
    out = write_tiny(root, (SEQ1, SEQ2))
    for seq in (SEQ1, SEQ2):
        with h5py.File(out[seq] / "part0_training.hdf5", "r") as f:
            arrays = {k: f[k][:N_EXAMPLES] for k in prep.FIELDS}
        assert len(arrays["input_ids"]) == N_EXAMPLES
        prep.write_shard(out[seq] / "part0_training.hdf5", arrays)
        prep.write_shard(out[seq] / "part1_training.hdf5", arrays)
    out["vocab_size"] = len(out["vocab"].read_text().splitlines())
    out["root"] = root
    return out


def tiny_cfg(data: dict, run_dir: Path, *overrides) -> dict:
    return compose_bert(
        "model=bert_tiny", f"model.vocab_size={data['vocab_size']}", "model.hidden_dropout_prob=0.0",
        "model.attention_probs_dropout_prob=0.0", f"data.dir={data[SEQ1]}", f"data.seq_len={SEQ1}",
        f"data.global_batch={2 * N_EXAMPLES}", "data.micro_batch=4", "steps=6", "log_every=2",
        "schedule.warmup_steps=1", "schedule.power=0.0", "trainer.nproc_per_node=2", "trainer.progress=false",
        "trainer.threads_per_worker=1", "trainer.device=cpu", "trainer.checkpoint.every=2", "trainer.checkpoint.keep=2",
        *overrides)


ROWS = {
    "lamb": ["experiment=bert/phase1_lamb", "optimizer.lr=0.05", "trainer.precision=fp32"],
    # a warm-up, as every recipe has: at step 1 the zero-initialised biases take the full, unclamped step
    # (trust ratio 1, as DeepSpeed), which at the full LR of 0.05 sets this tiny model's MLM head back
    "onebit_lamb": ["experiment=bert/phase1_onebit_lamb", "optimizer.lr=0.05", "optimizer.freeze_step=3",
                    "schedule.warmup_steps=3", "trainer.precision=fp32"],
    "slamb": ["experiment=bert/phase1_slamb", "optimizer.lr=0.05", "optimizer.sync_interval=3",
              "optimizer.min_compress_numel=500", "trainer.precision=fp16"],
}


def _worker(rank, world, jobs):
    """Every 2-worker check of this file in one job: process start-up dominates on a loaded 2-core machine."""
    import shutil

    from harness import barrier
    from slamb.optim.slamb import SLAMB

    SLAMB.allow_same_gradients = True  # both workers read the same 8 examples on purpose (tiny_data)
    out = {"harness": (_accumulated_grad(rank, world), _scaler_steps(rank, world)), "summaries": []}
    for cfg, run_dir, resume_from in jobs:
        if resume_from is not None:  # a copy of a finished run, rolled back to its step-4 checkpoint
            if rank == 0:
                shutil.copytree(resume_from, run_dir)
                ckpt = Path(run_dir) / "ckpt"
                out["latest_before"] = json.loads((ckpt / "latest.json").read_text())
                # latest.json is its checkpoint's record (complete.json: the step, each file's digest)
                latest = {"dir": "step000000004", **json.loads((ckpt / "step000000004" / "complete.json").read_text())}
                (ckpt / "latest.json").write_text(json.dumps(latest))
            barrier()
        out["summaries"].append(train(cfg, run_dir))
    return out


def history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


NAMES = [*ROWS, "phase2", "resumed"]


@pytest.fixture(scope="module")
def job(tiny_data) -> list[dict]:
    """Phase 1 with each row; phase 2 (seq 64) of SLAMB from SLAMB's phase-1 model; SLAMB resumed at step 4."""
    root = tiny_data["root"]
    jobs = [(tiny_cfg(tiny_data, root / f"run_{row}", *overrides), str(root / f"run_{row}"), None)
            for row, overrides in ROWS.items()]
    jobs.append((tiny_cfg(tiny_data, root / "run_phase2", *ROWS["slamb"], "steps=2",
                          f"init_from={root / 'run_slamb' / 'model'}", f"data.dir={tiny_data[SEQ2]}",
                          f"data.seq_len={SEQ2}", "data.phase=phase2", "paper.phase=2"), str(root / "run_phase2"), None))
    jobs.append((jobs[2][0], str(root / "run_resumed"), str(root / "run_slamb")))
    results = distributed.run(_worker, 2, jobs)
    for r in results:
        r["jobs"] = jobs
    return results


@pytest.fixture(scope="module")
def runs(job) -> dict:
    jobs = job[0]["jobs"]
    return {"dirs": {n: Path(j[1]) for n, j in zip(NAMES, jobs)},
            "summaries": dict(zip(NAMES, job[0]["summaries"])), "jobs": jobs, "latest_before": job[0]["latest_before"]}


@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.multiprocess
def test_two_workers_lower_the_loss_on_a_repeated_batch(runs, row):
    h = history(runs["dirs"][row])
    s = runs["summaries"][row]
    assert [r["step"] for r in h] == [2, 4, 6] and not any("epoch" in r for r in h)  # periods of steps
    losses = [r["loss"] for r in h]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.3, losses
    assert h[-1]["mlm_acc"] > h[0]["mlm_acc"] + 10
    assert all(0 <= r["nsp_acc"] <= 100 and r["seqs_per_s"] > 0 for r in h)
    assert (s["world_size"], s["accumulation_steps"], s["global_batch"]) == (2, 2, 2 * N_EXAMPLES)
    assert s["final_loss"] == h[-1]["loss"] and s["mean_seqs_per_s"] > 0
    assert s["bytes_total"]["all"] == sum(r["bytes/all"] for r in h) > 0


@pytest.mark.multiprocess
def test_each_row_sends_what_its_optimizer_sends(runs):
    grads = {row: runs["summaries"][row]["bytes_total"] for row in ROWS}
    params = sum(p.numel() for p in initial_model(OmegaConf.create(runs["jobs"][0][0]))
                 .parameters())
    # LAMB: one fp32 all-reduce of every gradient per step (accumulation communicates once, not twice)
    assert grads["lamb"]["grads"] == 6 * 4 * params
    # SLAMB: no gradient traffic; fp16 momentum each step, parameters every 3 steps, loss-scale agreements
    assert "grads" not in grads["slamb"] and grads["slamb"]["momentum"] > 0 and grads["slamb"]["params"] > 0
    assert grads["slamb"]["control"] >= 6 * 4
    assert grads["slamb"]["all"] < grads["lamb"]["all"] / 2
    # 1-bit LAMB: full gradients for the 3 warm-up steps, compressed after the freeze
    assert grads["onebit_lamb"]["all"] < grads["lamb"]["all"]


@pytest.mark.multiprocess
def test_fp16_run_logs_its_loss_scale(runs):
    h = history(runs["dirs"]["slamb"])
    assert all(r["loss_scale"] >= 1.0 for r in h) and runs["summaries"]["slamb"]["precision"] == "fp16"
    assert history(runs["dirs"]["lamb"])[0]["loss_scale"] == 1.0


@pytest.mark.multiprocess
def test_phase2_starts_from_phase1s_model(runs, tiny_data):
    dirs = runs["dirs"]
    model_dir = dirs["slamb"] / "model"
    assert (model_dir / "vocab.txt").read_text() == (tiny_data["root"] / "vocab" / "vocab.txt").read_text()
    phase2_cfg = OmegaConf.create(runs["jobs"][NAMES.index("phase2")][0])
    loaded, fresh = initial_model(phase2_cfg), build_model(phase2_cfg.model)
    last = dirs["slamb"] / "ckpt" / json.loads((dirs["slamb"] / "ckpt" / "latest.json").read_text())["dir"]
    r0, r1 = (torch.load(last / f"rank{r}.pt", weights_only=False)["model"] for r in (0, 1))
    assert not all(torch.equal(r0[k], r1[k]) for k in r0)  # SLAMB's ranks differ between model syncs
    for name, p in loaded.state_dict().items():  # the export is the mean of the ranks' final models
        assert torch.allclose(p, (r0[name] + r1[name]) / 2, atol=1e-6), name
    assert not torch.allclose(fresh.bert.embeddings.word_embeddings.weight, loaded.bert.embeddings.word_embeddings.weight)
    s2 = runs["summaries"]["phase2"]
    assert (s2["seq_len"], s2["phase"], s2["steps"]) == (SEQ2, "phase2", 2)
    assert s2["init_from"] == str(model_dir)
    # phase 1's weights start phase 2 (seq 64) below a fresh model's loss on the same batch
    batch = next(PretrainingStream(find_shards(tiny_data[SEQ2]), 8, 0, 1, seed=0, seq_len=SEQ2).micro_batches())
    with torch.no_grad():
        trained, untrained = (m.eval()(**batch).loss.item() for m in (loaded, fresh))
    assert trained < untrained - 0.1, (trained, untrained)
    with pytest.raises(FileNotFoundError, match="holds no saved model"):
        initial_model(OmegaConf.create({**runs["jobs"][NAMES.index("phase2")][0], "init_from": str(dirs["lamb"])}))


@pytest.mark.multiprocess
def test_auto_resume_from_a_mid_run_checkpoint_repeats_the_run(runs):
    """A copy of the finished SLAMB run rolled back to its step-4 checkpoint and rerun: steps 5-6 repeat exactly."""
    assert runs["latest_before"]["step"] == 6
    assert runs["summaries"]["resumed"]["resumed_from"] == [4]
    a, b = history(runs["dirs"]["slamb"]), history(runs["dirs"]["resumed"])
    assert [r["step"] for r in b] == [2, 4, 6]
    for ra, rb in zip(a, b):
        for key in ("loss", "mlm_acc", "nsp_acc", "lr", "loss_scale", "bytes_cum/all", "bytes_cum/momentum"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-5), (rb["step"], key)


@pytest.mark.multiprocess
def test_tables_render_the_pretraining_rows_per_phase(runs, tmp_path):
    from harness.records import load_runs
    from harness.tables import build_tables

    written = build_tables(load_runs(runs["dirs"]["lamb"].parent), tmp_path)
    assert {"bert_pretrain_phase1", "bert_pretrain_phase2"} <= set(written)
    md = (tmp_path / "bert_pretrain_phase1.md").read_text()
    rows = [line.split(" | ")[0].strip("| ") for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["Optimizer", "LAMB", "1-bit LAMB", "SLAMB"]
    slamb_line = next(line for line in md.splitlines() if line.startswith("| SLAMB"))
    ratio = runs["summaries"]["slamb"]["bytes_total"]["all"] / runs["summaries"]["lamb"]["bytes_total"]["all"]
    # the run and its resumed copy computed the same seed: counted once
    assert f"{ratio:.3f}x" in slamb_line and slamb_line.endswith("| 1 |")


BERT_EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment" / "bert").glob("*.yaml"))


@pytest.mark.parametrize("experiment", BERT_EXPERIMENTS)
def test_every_bert_experiment_composes_and_builds(experiment):
    cfg = compose_bert(f"experiment=bert/{experiment}", "model=bert_tiny")
    from harness import build_optimizer
    from harness.amp import PRECISIONS

    model = build_model(cfg["model"])
    opt = build_optimizer(model, cfg["optimizer"])
    build_lr_scheduler(opt, cfg["schedule"], 1, cfg["steps"])
    assert cfg["trainer"]["precision"] in PRECISIONS and cfg["paper"]["row"] and cfg["name"] == f"bert_{experiment}"
    # on the paper's 128 GPUs the recipe's global batch is reached exactly: phase 1 in 8 micro-batches of 64,
    # phase 2 in 16 of 16 (NVIDIA's settings for 80 GB GPUs)
    d = cfg["data"]
    assert accumulation_steps(d["global_batch"], d["micro_batch"], 128) == {128: 8, 512: 16}[d["seq_len"]]


def test_batch_metrics_need_no_host_synchronisation():
    """The per-micro-batch sums run no op whose output size or value the host must wait for on a GPU
    (boolean indexing's nonzero, scalar reads, tensors made from host data), and count what indexing did."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from bert.train import batch_sums

    class Syncs(TorchDispatchMode):
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                        torch.ops.aten._local_scalar_dense.default, torch.ops.aten.lift_fresh.default):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 30, (4, 16), generator=g)
    labels[torch.rand(4, 16, generator=g) < 0.8] = IGNORE_INDEX
    out = SimpleNamespace(prediction_logits=torch.randn(4, 16, 30, generator=g),
                          seq_relationship_logits=torch.randn(4, 2, generator=g), loss=torch.tensor(2.5))
    batch = {"labels": labels, "next_sentence_label": torch.randint(0, 2, (4,), generator=g)}
    mode = Syncs()
    with mode:
        sums = batch_sums(out, batch)
    assert mode.seen == []
    masked = labels != IGNORE_INDEX
    hits = (out.prediction_logits[masked].argmax(-1) == labels[masked]).sum()
    nsp_hits = (out.seq_relationship_logits.argmax(-1) == batch["next_sentence_label"]).sum()
    assert sums.tolist() == [2.5, float(hits), float(masked.sum()), float(nsp_hits), 4.0, 1.0]


@pytest.mark.multiprocess
def test_phase2_continues_only_the_optimizer_of_its_own_phase1(runs, tiny_data, tmp_path):
    """bert.train's checks before any worker starts: 1-bit LAMB's phase 2 continues the optimizer of the finished
    run whose model it starts from (init_optimizer_from follows init_from), of its optimizer and model, written by
    as many workers. Before, any run's state of the right shapes was continued, an older run's included."""
    from bert.train import check

    dirs = runs["dirs"]

    def phase2(init_from, *overrides):
        check(tiny_cfg(tiny_data, tmp_path / "p2", "experiment=bert/phase2_onebit_lamb", f"data.dir={tiny_data[SEQ2]}",
                       f"data.seq_len={SEQ2}", "optimizer.lr=0.05", "schedule.warmup_steps=1",
                       f"init_from={init_from}", *overrides))

    phase2(dirs["onebit_lamb"] / "model")  # its own phase 1: continued
    assert tiny_cfg(tiny_data, tmp_path, "experiment=bert/phase2_onebit_lamb", "init_from=/r/x/model")[
        "init_optimizer_from"] == "/r/x"
    with pytest.raises(ValueError, match=r"that run has optimizer.name='slamb' and this one "
                                         r"optimizer.name='onebit_lamb'"):
        phase2(dirs["slamb"] / "model")
    with pytest.raises(ValueError, match=r"is another run's model"):
        phase2(dirs["lamb"] / "model", f"init_optimizer_from={dirs['onebit_lamb']}")
    with pytest.raises(ValueError, match=r"written by 2 workers and this run has 1"):
        phase2(dirs["onebit_lamb"] / "model", "trainer.nproc_per_node=1")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(dirs["onebit_lamb"], unfinished)
    (unfinished / "metrics.json").unlink()
    with pytest.raises(ValueError, match=r"no finished run there"):
        phase2(unfinished / "model")
