"""Run a function in N local processes joined by a gloo process group.

For tests, benchmarks and examples that need a few workers on one machine
without a launcher; training jobs use :func:`harness.distributed.launch`.
"""
from __future__ import annotations

import faulthandler
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .distributed import forkserver, free_port, shutdown


def spawn(entry, args: tuple, nprocs: int, module: str) -> None:
    """``torch.multiprocessing.spawn(entry, args, nprocs)`` through a fork server that imported ``module``."""
    mp.start_processes(entry, args=args, nprocs=nprocs, join=True, start_method=forkserver(module))


def _entry(rank, fn, world_size, port, outdir, args):
    faulthandler.enable(all_threads=True)  # a native abort (SIGABRT/SIGSEGV) still shows where Python was
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A file rendezvous: a TCP store would bind a port chosen earlier by the parent, which another
    # socket can take in the seconds the spawned workers need to start. MASTER_PORT stays set for
    # code that reads it, but nothing binds it.
    store = os.path.join(outdir, "rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(outdir, f"{rank}.pt"))
    finally:
        shutdown()


def run_local(fn, world_size: int, *args) -> list:
    """``fn(rank, world_size, *args)`` in ``world_size`` gloo processes on 127.0.0.1; the results by rank.

    ``fn`` must be a module-level function (it is pickled into the worker processes).
    An exception in any worker is raised here.
    """
    with tempfile.TemporaryDirectory() as outdir:
        spawn(_entry, (fn, world_size, free_port(), outdir, args), world_size, fn.__module__)
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
