"""SLAMB, LAMB and AdamW under torchft: replica groups that die, come back and join a running job.

::

    group = slamb.integrations.torchft.connect(lighthouse, replica_id="3")   # this process's replica group
    opt = slamb.SLAMB(model.parameters(), process_group=group, ...)            # or LAMB / AdamW, no process_group
    ft = slamb.integrations.torchft.FaultTolerant(group, model, opt, heal="peer")
    while ft.committed_steps < steps:
        ft.start_step()                      # the quorum; a joining replica takes a peer's state here
        loss_fn(model(batch(ft.committed_steps + 1))).backward()
        if ft.step():                        # False: the step did not commit, and changed nothing
            log(loss)
        opt.zero_grad()

torchft (``pip install 'slamb[ft]'``; its lighthouse is ``torchft_lighthouse`` or
``torchft.coordination.LighthouseServer``) decides, step by step, which replica groups take part: a
quorum at the start of each step, and at its end a commit that fails when any collective of the
step failed (a peer died, or timed out). What this module adds for an optimizer whose collectives run
inside ``step()`` and whose replicas' states differ:

* every collective of SLAMB's step (the non-finite decision, the layout checks, the momentum exchange,
  the parameter syncs) runs through the manager: :class:`ManagedGroup` is a
  :class:`slamb.comm.Collectives` group, so ``slamb.comm`` hands it each one. A failed collective
  returns instead of hanging (its error recorded with the manager; every later one of the step returns
  at once), the step runs to its end on values that are discarded, and the commit fails;
* a step that does not commit is undone: :class:`FaultTolerant` copies the parameters, the state
  tensors (m, v, the staleness ages) and the step count before the step and puts them back after a
  failed commit (:class:`Undo`; the cost is one copy of each per step, measured in
  ``docs/fault_tolerance.md``). The masks are drawn from (seed, step), and the step count is what
  committed, so survivors of any quorum change draw the same masks;
* a joining replica (a relaunched one, a late one, or one whose commit failed while the others' did
  not) takes a peer's state through torchft's checkpoint transport, counted in the ledger as kind
  ``"heal"``, and ``heal`` sets what it keeps of it (:data:`HEAL_POLICIES`). The quorum is
  synchronous: the joining replica has its state before the step's first collective, and takes part
  in that step.

LAMB and AdamW (data-parallel: their state is the same on every replica) take one gradient
all-reduce through the manager (kind ``"grads"``), then the commit, then their step only if it
committed: nothing to undo. Their joining replicas take the peer's state (``heal="peer"``).

A replica group is one process, or several that shard its model (FSDP2's ``fully_shard`` on a 1-D mesh of the
group's own process group, as HSDP's shard dimension): SLAMB's worker is the replica group, and each of its
ranks meets the ranks holding the same shard in the other groups through its manager's process group (gloo on
the CPU, NCCL on GPUs), as HSDP's replicate dimension (:func:`slamb.sharding.sharded_topology`). A step
commits only where every rank of every group in the quorum commits it; a joining group's rank r takes rank r's
shards of a peer group.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.checkpointing import CheckpointTransport, HTTPTransport

from .. import comm
from ..averaging import average_tensors_
from ..contract import GRADIENT_ALLREDUCE, adopt
from ..optim.slamb import SLAMB
from ..sharding import local

__all__ = ["ManagedGroup", "HealTransport", "connect", "FaultTolerant", "Undo", "HEAL_POLICIES"]

# What a joining SLAMB replica keeps of the peer's state it receives (the parameters, m and v; the staleness
# ages are the same on every replica, a function of the masks drawn so far, and are always the peer's):
# * "peer": all of it, a copy of the peer (torchft's own rule, right for data-parallel state);
# * "mean": the peer's m and v; the parameters become the mean over the replicas that did not join, on every
#   replica (a parameter sync at the join, kind "heal": the joining replica counts for nothing in it);
# * "reset": the peer's parameters, m and v from zero (a fresh start of the moments at step t).
HEAL_POLICIES = ("peer", "mean", "reset")
DEFAULT_HEAL = "peer"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _nbytes(tree) -> int:
    if torch.is_tensor(tree):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(map(_nbytes, tree.values()))
    if isinstance(tree, (list, tuple)):
        return sum(map(_nbytes, tree))
    return 0


class _Work:
    """A collective in flight on the manager's process group: ``wait()`` returns, failed or not. On a failure
    (this one's, or an earlier one of the step) ``fallback()`` writes the output this replica then uses
    (see :class:`ManagedGroup`)."""

    def __init__(self, group: "ManagedGroup", work=None, fallback=None):
        self.group, self.work, self.fallback = group, work, fallback

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:  # torch.distributed's errors: a peer died, or timed out
                self.group.report(e)
            del work  # before failed() closes the connections: a collective in flight holds them open
        if self.group.failed() and self.fallback is not None:
            self.fallback()
        self.fallback = None


class ManagedGroup(comm.Collectives):
    """The replica groups of a torchft job as a :class:`slamb.comm.Collectives` group.

    Its size is the quorum's (the replicas taking part in this step), its rank this replica's place in
    it; both may change at each :meth:`FaultTolerant.start_step`. Every collective runs on the manager's
    process group ``pg`` (the one torchft reconfigures at each quorum change), its failure recorded with the
    manager, which then commits nothing of the step. Once a collective of the step failed, every later
    one returns at once with this replica's own values (an all-gather: its input in every slot): the
    step's values are discarded then, and no decision taken on them waits for a peer (:meth:`failed`).
    """

    def __init__(self, manager, pg, transport: "HealTransport | None" = None, store=None, *, process: int = 0,
                 processes: int = 1):
        self.manager, self.pg, self.transport = manager, pg, transport
        self.store = store  # the replica group's store: the manager and the quorum's process group use it
        # this process's rank among its replica group's processes, and their number (connect's rank, world_size)
        self.process, self.processes = process, processes
        self._closed_for = None  # the failure this replica closed its connections for

    def size(self) -> int:
        return max(1, self.manager.num_participants())  # 1 before the first quorum: nothing to reach yet

    def rank(self) -> int:
        return self.manager.participating_rank() or 0

    def report(self, error: Exception) -> None:
        """Record a failed collective with the manager: the step will not commit. A new exception without the
        traceback, whose frames would keep the failed collective (and its connections) alive."""
        self.manager.report_error(RuntimeError(f"{type(error).__name__}: {error}"))

    def failed(self) -> bool:
        """Whether a collective of this step failed. The first time it is seen, this replica closes its
        connections of the step (gloo closes them when its process group is freed): a peer still waiting
        on one of them (a ring's other neighbour of a dead replica) fails now rather than at its timeout.
        A failed step never commits, and torchft gives the next quorum a new process group."""
        error = self.manager.errored()
        if error is not None and error is not self._closed_for:
            self._closed_for = error
            self.pg.abort()
        return error is not None

    def _run(self, start, fallback=None, async_op=False):
        work = _Work(self, None, fallback)
        if not self.failed():
            self.manager.wait_quorum()
            try:
                work.work = start()
            except RuntimeError as e:
                self.report(e)
        if async_op:
            return work
        work.wait()

    def all_reduce(self, tensor, op, async_op=False):
        def start():
            opts = AllreduceOptions()
            opts.reduceOp = op
            return self.pg.allreduce([tensor], opts)

        return self._run(start, None, async_op)  # on failure the tensor is left as it is, and discarded

    def all_gather_into_tensor(self, output, input):
        n = self.size()

        def start():
            return self.pg.allgather([list(output.chunk(n))], [input], AllgatherOptions())

        self._run(start, lambda: output.copy_(input.reshape(-1).repeat(n).view_as(output)))

    def all_to_all_single(self, output, input, async_op=False):
        def start():
            return self.pg.alltoall_base(output, input, [], [], AllToAllOptions())

        return self._run(start, lambda: output.copy_(input), async_op)

    def broadcast(self, tensor, src):
        def start():
            opts = BroadcastOptions()
            opts.rootRank = src
            return self.pg.broadcast([tensor], opts)

        self._run(start)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class HealTransport(CheckpointTransport):
    """torchft's checkpoint transport (``inner``, an ``HTTPTransport`` by default) with the bytes a replica
    sends to joining ones recorded in ``ledger`` (kind ``"heal"``, op ``"send"``: the state's bytes once per
    receiver), set by :class:`FaultTolerant` to the optimizer's."""

    def __init__(self, inner: CheckpointTransport, ledger: comm.CommLedger | None = None):
        self.inner, self.ledger = inner, ledger

    def metadata(self) -> str:
        return self.inner.metadata()

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        if self.ledger is not None:  # in the quorum's thread, while the step waits for it
            for _ in dst_ranks:
                self.ledger.record("heal", "send", _nbytes(state_dict), 2)
        self.inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

    def disallow_checkpoint(self) -> None:
        self.inner.disallow_checkpoint()

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        return self.inner.recv_checkpoint(src_rank, metadata, step, timeout)

    def shutdown(self, wait: bool = True) -> None:
        self.inner.shutdown(wait)


def connect(lighthouse: str, replica_id: str, *, rank: int = 0, world_size: int = 1, store=None,
            min_replicas: int = 1, timeout: float = 60.0, quorum_timeout: float = 300.0, device: str = "cpu",
            host: str | None = None, init_sync: bool = True) -> ManagedGroup:
    """This process as (rank ``rank`` of the ``world_size`` processes of) replica group ``replica_id`` of the job
    whose lighthouse is at ``lighthouse`` (``http://host:port``): the manager's process group (gloo on ``"cpu"``,
    NCCL on ``"cuda"``), the checkpoint transport joining replicas heal through, and the manager, its quorum
    synchronous.

    ``store``: the replica group's :class:`torch.distributed.TCPStore`, hosted by its rank 0, where the group's
    managers meet (they write keys of their own: build the group's process group on a
    ``torch.distributed.PrefixStore`` of it). Needed for a group of several processes; one process alone gets a
    store of its own at ``host``.

    ``min_replicas``: a step commits only with at least this many replicas in it. ``timeout``: seconds a
    collective, a commit, a heal or a connection to a peer or the lighthouse may take before it fails (a dead
    peer is usually seen at once, as a closed connection; a peer that hangs, after this). ``quorum_timeout``:
    seconds a quorum may wait (for ``min_replicas`` replicas, or for a lighthouse that is gone) before
    ``start_step`` fails. ``init_sync``: the replicas start from one replica's
    state at step 0 (False: each from its own, e.g. all seeded alike). ``host``: the address other
    replicas reach this one's store at (default: this machine's name).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"invalid device={device!r}: must be 'cpu' (gloo) or 'cuda' (NCCL)")
    if not 0 <= rank < world_size:
        raise ValueError(f"invalid rank={rank} of world_size={world_size}: must be 0 .. world_size - 1")
    if store is None and world_size > 1:
        raise ValueError(f"a replica group of world_size={world_size} processes meets through its store: pass store=, "
                         "a TCPStore its rank 0 hosts")
    host = host or socket.gethostname()
    limit = timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=limit) if device == "cpu" else ProcessGroupNCCL(timeout=limit)
    transport = HealTransport(_quiet(HTTPTransport(timeout=limit, num_chunks=0)))
    manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                      use_async_quorum=False, timeout=limit, quorum_timeout=timedelta(seconds=quorum_timeout),
                      connect_timeout=limit, replica_id=replica_id, store_addr=store.host, store_port=store.port,
                      rank=rank, world_size=world_size, lighthouse_addr=lighthouse, checkpoint_transport=transport,
                      init_sync=init_sync)
    return ManagedGroup(manager, pg, transport, store, process=rank, processes=world_size)


def _quiet(transport: HTTPTransport) -> HTTPTransport:
    """``transport`` without the line its heal server writes on stderr for every request it serves (each chunk of
    each heal: http.server's access log), which torchft has no setting for; its errors still go to its logger."""
    server = getattr(transport, "_server", None)
    if server is not None:
        server.RequestHandlerClass.log_message = lambda handler, format, *args: None
    return transport


class Undo:
    """What puts an optimizer and its parameters back as they were before a step: a copy of the parameters,
    of every tensor of ``optimizer.state`` and of its step count (see :attr:`slamb.optim.base.
    LocalStateOptimizer.steps`), taken into buffers kept from step to step.

    A state tensor the step created (the first step's moments) is zeroed by :meth:`restore`: the state a
    fresh optimizer starts from.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.keys: list = []
        self.copies: list[torch.Tensor] = []
        self.steps = 0

    def _tensors(self) -> tuple[list, list[torch.Tensor]]:
        params = [local(p) for g in self.optimizer.param_groups for p in g["params"]]
        keys, tensors = list(range(len(params))), list(params)
        for i, p in enumerate(params):
            for name, t in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(t):
                    keys.append((i, name))
                    tensors.append(t)
        return keys, tensors

    @torch.no_grad()
    def take(self) -> None:
        keys, tensors = self._tensors()
        if keys != self.keys:  # state tensors a step created (a first step's): new buffers, else the same ones
            self.keys, self.copies = keys, [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self.copies, [t.detach() for t in tensors])
        self.steps = self.optimizer.steps

    @torch.no_grad()
    def restore(self) -> None:
        saved = dict(zip(self.keys, self.copies))
        keys, tensors = self._tensors()
        back = [(t, saved[k]) for k, t in zip(keys, tensors) if k in saved]
        torch._foreach_copy_([t for t, _ in back], [s for _, s in back])
        for k, t in zip(keys, tensors):
            if k not in saved:
                t.zero_()
        self.optimizer.steps = self.steps

    def nbytes(self) -> int:
        return _nbytes(self.copies)


class FaultTolerant:
    """Steps ``optimizer`` (training ``model``) under the torchft manager of ``group`` (:func:`connect`).

    ``optimizer``: :class:`slamb.SLAMB` built with ``process_group=group`` (its collectives run inside
    ``step()``, which is undone when it does not commit), or a data-parallel optimizer
    (``slamb.LAMB``, ``torch.optim.AdamW``: any with ``communication == "gradient_allreduce"``), whose
    gradients this class averages through the manager before the commit. ``heal``: what a joining
    replica keeps of the peer's state it receives, :data:`HEAL_POLICIES` (SLAMB only; data-parallel
    optimizers take the peer's).

    Per step, on every replica: :meth:`start_step` before the forward pass, :meth:`step` after
    backward. ``committed_steps`` is the manager's count of committed steps: number the data by it
    (the batch of step ``committed_steps + 1``), so a step that did not commit is taken again on
    the same samples, and a joining replica continues where the others are.
    """

    def __init__(self, group: ManagedGroup, model: torch.nn.Module, optimizer, *, heal: str = DEFAULT_HEAL):
        if heal not in HEAL_POLICIES:
            raise ValueError(f"invalid heal={heal!r}: must be one of {HEAL_POLICIES}")
        self.group, self.manager = group, group.manager
        self.model = getattr(model, "module", model)
        self.optimizer = adopt(optimizer)
        # the optimizer's own step, kept: a caller may then route ``optimizer.step()`` to :meth:`step`
        self._optimizer_step = optimizer.step
        self.local = isinstance(optimizer, SLAMB)
        if self.local:
            bad = [what for what, on in (("overlap=True", optimizer.overlap), (f"hierarchy={optimizer.hierarchy!r}",
                   optimizer.hierarchy is not None)) if on]
            # sharded: the replica group's ranks each hold a shard, and meet the other groups through the manager
            replicas = optimizer.process_group if optimizer.shards is None else optimizer.shards.replicate
            if replicas is not group or bad:
                raise ValueError("SLAMB under torchft runs its collectives through the manager: build it with "
                                 "process_group=group (the ManagedGroup of connect()), without "
                                 f"{', '.join(bad) or 'another process group'}")
            # before the first quorum (no peer to check with yet): a replica joining later then runs the same
            # collectives as the others from its first step, where building its layout would run its own
            optimizer.fix_layout()
            self.undo = Undo(optimizer)
        elif self.optimizer.communication != GRADIENT_ALLREDUCE:
            raise ValueError(f"{type(optimizer).__name__} under torchft: SLAMB, or a data-parallel optimizer "
                             "(LAMB, AdamW: communication='gradient_allreduce'), is supported")
        elif heal != "peer":
            raise ValueError(f"invalid heal={heal!r} for {type(optimizer).__name__}: a data-parallel optimizer's "
                             "state is the same on every replica, a joining one takes the peer's (heal='peer')")
        self.heal = heal
        self._before = None  # the manager's state before this step's quorum
        self._uncommitted = 0  # steps that did not commit: their number names their keys in the group's store
        self.joined = False  # healed with heal="mean", the mean over the others still to take
        self.heals = 0  # states this replica received
        if group.transport is not None:
            group.transport.ledger = self.optimizer.ledger
        self.manager.register_state_dict_fn("slamb", self._load, self._state)

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def start_step(self) -> None:
        """The quorum of this step; a replica that is behind takes a peer's state now (:meth:`_load`)."""
        self._before = self.manager.state_dict()
        self.manager.start_quorum()

    def _not_committed(self) -> bool:
        """After a step that did not commit: a replica whose state a heal at this quorum brought to the others'
        step keeps it, since an undone step leaves the state as it was healed and a second heal would send the
        same state again. Only where another process of its group failed to take its state does it go back to
        the step it was at before, so that the whole group heals again at the next quorum: torchft takes the
        group's step from whichever of its processes asks for a quorum last, and a process left behind would
        otherwise train on with another step's state."""
        healed = self._before is not None and self.manager.current_step() != self._before["step"]
        if self.group.processes > 1 and not self._group_at(self.manager.current_step()) and healed:
            self.manager.load_state_dict(self._before)
        return False

    def _group_at(self, step: int) -> bool:
        """Whether every process of this replica group holds ``step`` after this quorum, told through the group's
        store by each process after the same step that did not commit (every process gets there: the commit's
        vote is the group's). A process that does not answer within the store's timeout counts as behind."""
        self._uncommitted += 1
        store, key = self.group.store, f"slamb/uncommitted/{self._uncommitted}/"
        others = [key + str(p) for p in range(self.group.processes) if p != self.group.process]
        try:
            store.set(key + str(self.group.process), str(step))
            store.wait(others)
            return all(int(store.get(k)) == step for k in others)
        except (RuntimeError, ValueError):  # the store's timeout, or its host gone (torch's Dist*Error)
            return False

    def step(self, before_commit=None, clip_grad: float | None = None) -> bool:
        """The optimizer's step under the manager; whether it committed (if not, nothing changed).

        ``before_commit()``: collectives of the caller's (through the group) that commit with the step, run
        after SLAMB's step (a data-parallel optimizer's: after its gradient all-reduce, as it steps only once
        committed); their results hold only if the step commits. ``clip_grad``: clip the gradients' global norm
        to it before the optimizer's step, after their average where the optimizer is data-parallel (as under
        DDP, whose average precedes the caller's clipping; SLAMB's gradients are each replica's own)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not self.local:
            average_tensors_([local(p.grad) for p in params], process_group=self.group, ledger=self.optimizer.ledger,
                             kind="grads")
        if clip_grad:
            torch.nn.utils.clip_grad_norm_(params, clip_grad, foreach=True)
        if not self.local:
            if before_commit is not None:
                before_commit()
            if not self.manager.should_commit():
                self.optimizer.ledger.end_step()  # the attempt's bytes, a step of the ledger as SLAMB's are
                return self._not_committed()
            self._optimizer_step()
            return True
        self.undo.take()
        try:
            if self.heal == "mean":
                self._mean_at_join()
            self._optimizer_step()
            if before_commit is not None:
                before_commit()
        except Exception:
            if self.manager.errored() is None:  # the optimizer's own error, not a failed collective
                self.undo.restore()
                raise
        if self.manager.should_commit():
            self.joined = False
            return True
        self.undo.restore()
        return self._not_committed()

    @torch.no_grad()
    def _mean_at_join(self) -> None:
        """heal="mean": where replicas joined at this step's quorum, every replica's parameters become the
        mean over the others (one 4-byte all-reduce each step, kind "control", to learn of a join)."""
        params = [local(p) for g in self.optimizer.param_groups for p in g["params"]]
        count = torch.tensor([float(self.joined)], device=params[0].device)
        comm.all_reduce_sum_(count, kind="control", ledger=self.optimizer.ledger, group=self.group)
        joined, n = int(count.item()), self.group.size()
        if 0 < joined < n:
            if self.joined:
                torch._foreach_zero_(params)
            average_tensors_(params, process_group=self.group, ledger=self.optimizer.ledger, kind="heal")
            torch._foreach_mul_(params, n / (n - joined))

    # -- healing: what a replica sends, and what a joining one keeps ---------------------------------------

    def _state(self) -> dict:
        """This replica's state for a joining one. By reference: nothing changes the parameters and the
        optimizer's state before the joining replica holds its copy (it reads them within its quorum, and this
        replica's step waits for it at its first collective); the buffers (BatchNorm's statistics) change in
        the forward pass that runs meanwhile, and are copied."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {i: {name: local(t).detach() for name, t in self.optimizer.state.get(p, {}).items()
                     if torch.is_tensor(t)} for i, p in enumerate(params)}
        weights = dict(self.model.named_parameters())
        # a sharded model's: this rank's shards, which the joining group's rank of the same shard receives (a tied
        # weight's second name, which named_parameters() leaves out, copied with the buffers)
        model = {k: local(v) if k in weights else local(v).clone() for k, v in self.model.state_dict().items()}
        return {"model": model, "state": state, "steps": getattr(self.optimizer, "steps", None)}

    @torch.no_grad()
    def _load(self, received: dict) -> None:
        """A peer's state, kept as ``heal`` says."""
        own = self.model.state_dict()
        if set(own) != set(received["model"]):
            raise ValueError(f"a peer's state for another model: {sorted(set(own) ^ set(received['model']))[:4]}")
        for k, v in own.items():  # in place, into this rank's shards of a sharded model
            local(v).copy_(received["model"][k])
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            mine = self.optimizer.state.setdefault(p, {})
            theirs = received["state"].get(i, {})
            for name, t in theirs.items():
                if self.heal == "reset" and name in MOMENTS:
                    t = torch.zeros_like(t)
                if torch.is_tensor(mine.get(name)):
                    mine[name].copy_(t)  # in place: SLAMB's state tensors are views of its flat buffers
                else:
                    mine[name] = t.to(p.device)
            for name, t in mine.items():
                if torch.is_tensor(t) and name not in theirs:
                    t.zero_()
        if received["steps"] is not None:
            self.optimizer.steps = received["steps"]
            self.joined = self.heal == "mean" and received["steps"] > 0  # at step 0 every replica is the same
        self.heals += 1
