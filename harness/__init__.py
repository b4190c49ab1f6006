"""The harness every pipeline shares (CIFAR-10, Swin/ImageNet, BERT, SQuAD).

* :mod:`.distributed`: the one launch path (torchrun, or local workers via the
  elastic launcher), process-group set-up, the fault-injection test hook;
* :mod:`.seeding`: per-rank seeds, deterministic mode, RNG state for checkpoints;
* :mod:`.checkpoint`: atomic, rank-aware checkpoints, auto-resume with a
  fallback to the previous checkpoint, the run's inputs checked on resume, the
  checks made before any worker starts (:func:`.checkpoint.prepare_run`);
* :mod:`.run`: the run directory (config, git revision, metrics.jsonl /
  metrics.json, wandb, progress bar), the ledger's byte columns;
* :mod:`.lock`: the run directory's lock, which records the job's processes, and
  workers that end with their launcher;
* :mod:`.settings`: what counts as a run's configuration (the settings that
  do not change what it computes, the inputs checked on resume, those left
  out of the run directory's name), the checks of counts and schedules;
* :mod:`.atomic`: files written whole or not at all;
* :mod:`.data`: per-rank index batches (``DistributedSampler.set_epoch``);
* :mod:`.loop`: what every training loop shares (resume, the schedules of the optimizer contract,
  evaluation of the ranks' averaged model, period logging, checkpoint cadence, the run summary);
* :mod:`.build`: optimizers from configs, settings checks, the Hydra entry;
* :mod:`.parallel`: ``trainer.parallelism``, DDP or FSDP/HSDP (per-layer sharding on the run's mesh);
* :mod:`.fault_tolerance`, :mod:`.replica`: ``trainer.fault_tolerance=torchft``, replica groups that fail and
  rejoin a running job (the launcher and the managed steps; a worker's replica group);
* :mod:`.tables`: results tables and plots from run directories.
"""
from .build import build_optimizer, check_trainer, command, continue_optimizer, optimizer_kwargs, run_from_hydra
from .checkpoint import (Checkpointer, data_streams, open_run, restore_training, save_training, step_micro_batches,
                         unwrap)
from .data import ShardedBatches, StepReader, eval_shard
from .loop import PERIOD_HOOKS, Loop, check_counts, rank_sums, save_state_dict, summary_line
from .parallel import distribute
from .distributed import (DistEnv, barrier, evaluation_env, init_distributed, launch, maybe_inject_fault,
                          under_torchrun)
from .run import RunLogger, comm_metrics, comm_totals, git_revision
from .seeding import seed_everything
from .records import compressed_share

__all__ = [
    "build_optimizer", "check_trainer", "command", "optimizer_kwargs", "run_from_hydra", "Checkpointer", "open_run",
    "continue_optimizer", "restore_training", "step_micro_batches", "data_streams",
    "save_training", "unwrap", "ShardedBatches", "StepReader", "eval_shard", "evaluation_env", "DistEnv", "barrier",
    "init_distributed", "launch",
    "maybe_inject_fault", "under_torchrun", "RunLogger", "comm_metrics", "comm_totals", "compressed_share",
    "git_revision",
    "seed_everything", "distribute", "Loop", "PERIOD_HOOKS", "check_counts", "rank_sums", "save_state_dict",
    "summary_line",
]
