"""Fine-tune BERT on SQuAD v1.1 and report the official exact match and F1.

    python -m squad_finetune.train model.dir=runs/bert_phase2_lamb/model   # 4 local workers
    python -m squad_finetune.train experiment=squad/slamb trainer.nproc_per_node=8
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        -m squad_finetune.train experiment=squad/lamb                     # multi-node

``model.dir`` is a local BERT directory (``config.json`` + weights +
``vocab.txt`` / tokenizer files, as ``save_pretrained`` writes them): a
pre-trained ``BertForPreTraining`` gets a fresh span head, a
``BertForQuestionAnswering`` keeps its own. The recipe is the standard one:
2 epochs, AdamW at LR 3e-5, global batch 32, linear warm-up over 10% of the
steps then linear decay, max length 384, doc stride 128. After every epoch
the whole dev set is scored by the run's model, the ranks' average (each rank
its strided shard of windows, logits summed to every rank), and rank 0 writes
``predictions.json``, ``nbest_predictions.json`` and the exact match / F1 into
the run directory. Under SLAMB, whose ranks' parameters differ between model
syncs, the local models' scores are logged beside them (``f1_local``, ...).
"""
from __future__ import annotations

import math
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

import slamb
from slamb import comm
import harness
from harness.accumulate import split_batch
from harness.amp import MixedPrecision, accumulation_context
from harness.seeding import reseed
from harness.atomic import atomic_write_json
from slamb.optim.checks import check_choice
from harness.schedules import build_lr_scheduler, check_lr_schedule

from .data import Features, check_windows, fingerprint, load_squad, load_tokenizer, make_features
from .evaluate import evaluate_examples
from .postprocess import check_answers, postprocess

INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def load_model(model_dir, vocab_size: int):
    """``BertForQuestionAnswering`` from a local directory; clear errors instead of hub look-ups."""
    from transformers import BertForQuestionAnswering

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model.dir={d}: expected a BERT checkpoint saved with "
                                "save_pretrained (the bert/ phase-2 output or any local Hugging Face BERT)")
    try:
        model = BertForQuestionAnswering.from_pretrained(str(d), local_files_only=True)
    except OSError as e:
        raise FileNotFoundError(f"cannot load BERT weights from model.dir={d}: {e}") from None
    if vocab_size > model.config.vocab_size:
        raise ValueError(f"the vocabulary of {d} has {vocab_size} tokens but the model embeds only "
                         f"{model.config.vocab_size}: the tokenizer does not belong to this checkpoint")
    return model


def subset(examples, limit):
    return examples if limit is None else examples[:int(limit)]


def batch_inputs(features: Features, idx: torch.Tensor, device) -> dict[str, torch.Tensor]:
    return {k: getattr(features, k)[idx].to(device, non_blocking=True).long() for k in INPUTS}


@torch.no_grad()
def predict(model, features: Features, env, batch_size: int, amp) -> tuple[torch.Tensor, torch.Tensor]:
    """Start and end logits of every window on every rank; each rank computes its strided shard."""
    model = harness.unwrap(model)  # ranks hold different numbers of windows: no DDP collective may run here
    model.eval()
    idx = harness.eval_shard(len(features), env)
    logits = torch.zeros(2, *features.input_ids.shape, device=env.device)
    for lo in range(0, len(idx), batch_size):
        b = idx[lo:lo + batch_size]
        with amp.autocast():
            out = model(**batch_inputs(features, b, env.device))
        logits[0, b.to(env.device)] = out.start_logits.float()
        logits[1, b.to(env.device)] = out.end_logits.float()
    # the other ranks' rows are zero here, so the sum assembles every window exactly
    comm.all_reduce_sum_(logits, kind="eval", ledger=None)  # bookkeeping, not training traffic
    return logits[0].cpu(), logits[1].cpu()


def score(examples, features, logits, cfg, run_dir, env) -> dict[str, float]:
    """Rank 0: post-process, write the predictions (over those of earlier calls), return EM / F1
    (NaN on the other ranks)."""
    if not env.is_main:
        return {"exact_match": math.nan, "f1": math.nan}
    predictions, nbest = postprocess(examples, features, *logits, n_best=cfg.eval.n_best,
                                     max_answer_length=cfg.eval.max_answer_length)
    atomic_write_json(predictions, Path(run_dir) / "predictions.json")
    atomic_write_json(nbest, Path(run_dir) / "nbest_predictions.json")
    return evaluate_examples(examples, predictions)


def check(cfg: dict) -> None:
    """This pipeline's settings, before any worker starts (:func:`harness.build.check_settings`) and in
    :func:`train`: the precision, the windows, the answers' post-processing, the schedule."""
    # fp16 stays refused: the shared step's loss scaling has not been tried on fine-tuning (bf16 needs none)
    check_choice("trainer.precision", cfg["trainer"]["precision"], ("fp32", "bf16"))
    d = cfg["data"]
    check_windows(d["max_length"], d["doc_stride"], d["max_query_length"])
    check_answers(cfg["eval"]["n_best"], cfg["eval"]["max_answer_length"])
    check_lr_schedule(cfg["schedule"], cfg["epochs"])


def inputs(cfg: dict) -> dict:
    """What the run reads, by content (:mod:`harness.identity`): its training and dev files (the model it
    fine-tunes is named by the run that saved it)."""
    return {key: fingerprint(cfg["data"][key.split(".")[1]]) for key in ("data.train_file", "data.dev_file")}


def check_inputs(cfg: dict) -> None:
    """:func:`check`, and the SQuAD files read as the workers will read them, before any worker starts: a file that
    is not SQuAD's JSON ends the command in one line naming its setting (the workers read them again)."""
    check(cfg)
    for key in ("train_file", "dev_file"):
        try:
            load_squad(cfg["data"][key])
        except ValueError as e:
            raise ValueError(f"invalid data.{key}={cfg['data'][key]!r}: {e}") from None


def train(cfg: dict, run_dir: str) -> dict:
    plain, cfg = cfg, OmegaConf.create(cfg)
    t, d = cfg.trainer, cfg.data
    harness.check_counts(cfg, "epochs")
    check(plain)
    env = harness.init_distributed(t.device, t.threads_per_worker, t.timeout_s, tf32=t.tf32, cudnn_benchmark=t.cudnn_benchmark)

    tokenizer = load_tokenizer(cfg.model.dir, cfg.model.do_lower_case)
    shape = {"max_length": d.max_length, "doc_stride": d.doc_stride, "max_query_length": d.max_query_length}
    train_examples = subset(load_squad(d.train_file), d.max_train_examples)
    dev_examples = subset(load_squad(d.dev_file), d.max_dev_examples)
    train_feats = make_features(train_examples, tokenizer, **shape)
    dev_feats = make_features(dev_examples, tokenizer, **shape)
    # each step's global batch is cut into one micro-batch per worker of the run's first start, however many
    # workers resume it: fewer accumulate several each, so every step takes the same windows
    micro_batches = harness.step_micro_batches(run_dir, t.resume, env.world_size)
    batches = harness.ShardedBatches(len(train_feats), split_batch(d.global_batch, micro_batches), env,
                                     seed=cfg.seed, micro_batches=micro_batches)
    accum = len(batches.shards)  # this worker's micro-batches of each step
    steps_per_epoch = len(batches)
    if env.is_main:
        print(f"SQuAD: {len(train_examples)} train questions -> {len(train_feats)} windows, {len(dev_examples)} "
              f"dev questions -> {len(dev_feats)} windows; {env.world_size} workers x {accum} x "
              f"{batches.batch_size}, {steps_per_epoch} steps per epoch", flush=True)

    torch.manual_seed(cfg.seed)  # the same fresh span head on every rank (DDP also broadcasts rank 0's)
    model = load_model(cfg.model.dir, len(tokenizer)).to(env.device)
    optimizer = harness.build_optimizer(model, plain["optimizer"])
    params = [p for p in model.parameters() if p.requires_grad]
    amp = MixedPrecision(t.precision, env.device, optimizer=optimizer)
    # BERT's buffers (position ids) are constants: broadcasting them every forward would only cost bytes
    model = slamb.wrap_model(model, optimizer, forward_sync_buffers=False)
    scheduler = build_lr_scheduler(optimizer, cfg.schedule, steps_per_epoch, steps_per_epoch * cfg.epochs)
    harness.seed_everything(cfg.seed, env.rank, t.deterministic)
    run = harness.Loop(run_dir, env, cfg, plain, model=model, optimizer=optimizer, scheduler=scheduler, amp=amp,
                       global_batch=d.global_batch, throughput="sequences", micro_batches=micro_batches,
                       steps_per_epoch=steps_per_epoch)

    def dev_scores() -> dict:  # under torchft, each group that committed writes the same predictions (atomically)
        logits = predict(model, dev_feats, run.eval_env, d.eval_batch, amp)
        return score(dev_examples, dev_feats, logits, cfg, run_dir, run.eval_env)

    for epoch in run.epochs():
        optimizer.begin_epoch(epoch)  # DGC's density and SLAMB's compression warm-ups
        model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=env.device)  # loss sum, steps: no host sync per step
        for step in run.steps(batches.epoch(epoch), total=steps_per_epoch, desc=f"epoch {epoch + 1}", totals=sums):
            optimizer.begin_step()  # JointSpar: draw this round's layers, freeze the others
            optimizer.zero_grad(set_to_none=True)
            for j, idx in enumerate(step):
                # dropout draws from (seed, step, the micro-batch's place in the step), not this worker's stream
                reseed(cfg.seed, run.step, batches.shards[j])
                with accumulation_context(model, last_micro_batch=j == accum - 1):
                    with amp.autocast():
                        loss = model(**batch_inputs(train_feats, idx, env.device),
                                     start_positions=train_feats.start_positions[idx].to(env.device),
                                     end_positions=train_feats.end_positions[idx].to(env.device)).loss.float() / accum
                    if loss.requires_grad:  # False only in a JointSpar round that sampled no layer
                        amp.backward(loss)
                sums[0] += loss.detach().double()
            sums[1] += 1
            run.optimizer_step(params)
            scheduler.step()
        loss_sum, steps = harness.rank_sums(sums)
        metrics = run.evaluate(dev_scores)
        run.end_epoch(epoch, {"train_loss": loss_sum / max(steps, 1), **metrics}, steps=steps_per_epoch)

    return run.finish(headline=("exact_match", "f1"), model_dir=str(cfg.model.dir), train_windows=len(train_feats),
                      dev_questions=len(dev_examples), exact_match=run.last("exact_match"), f1=run.last("f1"))


# how this pipeline is checked and launched: its main, and a script's checks of every run before the first
# (harness.preflight)
LAUNCH = {"check": check_inputs, "fault_tolerant": True}


@hydra.main(version_base="1.3", config_path="../configs", config_name="squad")
def main(cfg) -> dict:
    return harness.run_from_hydra("squad_finetune.train:train", cfg, inputs=inputs, **LAUNCH)


if __name__ == "__main__":
    harness.command(main)
