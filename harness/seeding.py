"""Seeding: one seed per run, offset per rank, and an opt-in deterministic mode."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0, deterministic: bool = False) -> int:
    """Seed python, numpy and torch (all devices) with ``seed + rank``; returns it.

    Ranks get different streams (augmentation, dropout) while the model's
    initial weights come from DDP's broadcast of rank 0. ``deterministic``
    makes every kernel deterministic (an error where none exists), so two
    runs of the same config on the same hardware match bit for bit.
    """
    local = int(seed) + int(rank)
    random.seed(local)
    np.random.seed(local % 2**32)
    torch.manual_seed(local)
    if deterministic:
        # cuBLAS needs a fixed workspace for deterministic GEMMs; harmless elsewhere
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    return local


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every RNG a step may draw from with a stream of (``seed``, ``step``, ``rank``): where a run resumes
    on another number of workers, whose saved streams are not this rank's to continue, or where a draw must not
    depend on the worker (BERT's dropout, keyed by micro-batch in place of ``rank``)."""
    local = int(np.random.SeedSequence([int(seed), int(step), int(rank)]).generate_state(1)[0])
    random.seed(local)
    np.random.seed(local)
    torch.manual_seed(local)


def rng_state() -> dict:
    """Every RNG a training step may draw from, for checkpoints.

    Of the accelerator, only the current device's generator: each worker draws on its own device,
    and a resume may see another number or order of visible devices.
    """
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        state["accelerator"] = (acc.type, torch.get_device_module(acc.type).get_rng_state())
    return state


def set_rng_state(state: dict) -> None:
    """Restore :func:`rng_state`; states are made CPU ByteTensors, as the generators require."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    saved = state.get("accelerator")
    if saved is None or not torch.accelerator.is_available():
        return
    kind, states = saved
    if kind != torch.accelerator.current_accelerator().type:
        print(f"not restoring the {kind} RNG state: this run has no {kind} device", flush=True)
        return
    module = torch.get_device_module(kind)
    if isinstance(states, (list, tuple)):  # every visible device's, by index (older checkpoints)
        index = torch.accelerator.current_device_index()
        if len(states) != module.device_count():
            print(f"not restoring the {kind} RNG state: the checkpoint saw {len(states)} devices and this run "
                  f"sees {module.device_count()}", flush=True)
            return
        states = states[index]
    module.set_rng_state(states.to("cpu", torch.uint8))
