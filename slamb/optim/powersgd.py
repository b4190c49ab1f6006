"""PowerSGD (Vogels et al., NeurIPS 2019): momentum SGD on gradients averaged
through a rank-r approximation, torch's ``powerSGD_hook`` with a byte ledger.

The gradient exchange is torch's own hook
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``), run as
DDP's comm hook by :func:`slamb.wrap_model`. Per DDP bucket, from DDP's
``start_powerSGD_iter``-th backward on:

1. the local error of the previous step is added to the gradient (error feedback);
2. every tensor viewed as an (n, m) matrix (``shape[0]`` rows) whose rank-r
   factors are at least ``min_compression_rate`` times smaller than itself,
   ``(n + m) r min_compression_rate < n m``, is compressed; the others (biases,
   norms, small matrices) are all-reduced as they are (kind ``"grads"``);
3. P = M Q (Q from the previous step: warm start), one all-reduce of every P
   of the bucket (kind ``"powersgd_p"``), P orthogonalised;
4. Q = M^T P, one all-reduce of every Q (kind ``"powersgd_q"``), divided by n;
5. the averaged gradient is P Q^T, the same on every rank; the error is what
   the approximation left out of this rank's gradient.

Before that step DDP's gradients are all-reduced whole (kind ``"grads"``):
DDP rebuilds its buckets after the first backward, and error feedback and
warm start are kept per bucket.

Choices, each named:

* The inner optimizer is ``torch.optim.SGD`` (momentum, Nesterov, weight
  decay), as in the PowerSGD paper; the momentum applies to the averaged,
  decompressed gradient, which is identical on every rank, so the parameters
  stay identical too.
* The bytes are recorded where they leave: torch's hook talks to a process
  group that records each all-reduce in this optimizer's ledger before
  handing it to the real group, and tells P from Q from the uncompressed
  gradients by the tensor it is handed (PowerSGD state's P and Q buffers).
* Buckets are exchanged one after the other (each waits for the previous
  one's result): torch's hook issues P's and Q's all-reduces from callbacks,
  which gloo runs on its own threads, and two buckets in flight can then
  reach the collectives in a different order on each rank and hang. Within a
  bucket torch's hook already waits for each all-reduce in turn.
* Checkpoints: ``state_dict()`` carries the PowerSGD state of this rank (its
  error-feedback buffers and the warm-start Q of each compressed tensor, the
  iteration and the random generator of Q's initialisation) per parameter:
  torch keeps it per DDP bucket, and a resumed run's DDP cuts its buckets
  anew (a resumed run continues bit for bit, whatever its ``bucket_cap_mb``).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState, _should_compress,
                                                                      powerSGD_hook)
from torch.optim.sgd import sgd

from .. import comm
from ..contract import OPTIMIZER_HOOK, ContractDefaults, check_rank_stamp, rank_stamp
from .checks import check_choice, check_count, check_process_group, check_range
from .precision import promote_state_, working_copies, write_back_

_KEY = "powersgd"


class _RecordingGroup(dist.ProcessGroup):
    """The process group torch's hook talks to: each all-reduce recorded in the ledger, then run by ``group``."""

    def __init__(self, group: dist.ProcessGroup, optimizer: "PowerSGD"):
        super().__init__(group.rank(), group.size())
        self.group = group
        self.optimizer = optimizer

    def getBackendName(self) -> str:
        return self.group.getBackendName()

    def allreduce(self, tensors, opts):
        state = self.optimizer.powersgd
        for t in tensors:
            if any(t is p for p in state.p_memory_dict.values()):
                kind = "powersgd_p"
            elif any(t is q for q in state.q_memory_dict.values()):
                kind = "powersgd_q"
            else:
                kind = "grads"
            self.optimizer.ledger.record(kind, "all_reduce", t.numel() * t.element_size(), self.size())
        return self.group.allreduce(tensors, opts)


def powersgd_comm_hook(optimizer, bucket):  # unannotated: DDP checks annotations, which are strings here
    """torch's ``powerSGD_hook`` on the optimizer's state, one bucket after the other.

    torch's hook issues a bucket's P and Q all-reduces from callbacks of its first one; under gloo
    those run on the backend's threads, so with two buckets in flight the ranks can reach the
    collectives in different orders and hang. Waiting for the previous bucket keeps one order.
    """
    if optimizer._in_flight is not None:
        optimizer._in_flight.wait()
    optimizer._enter_bucket(bucket)
    fut = powerSGD_hook(optimizer.powersgd, bucket)
    optimizer._in_flight = None if bucket.is_last() else fut
    return fut


def factor_layout(shapes, rank: int, min_compression_rate: float) -> list[tuple[int, int, int, int]]:
    """(position in the bucket, n, m, r) of the compressed tensors, in the order of torch's P and Q buffers.

    torch's hook views each tensor as (shape[0], rest), compresses those its ``_should_compress``
    accepts, and lays their factors out by shape, shapes in order of first appearance.
    """
    by_shape: dict[tuple[int, int], list] = {}
    for i, shape in enumerate(shapes):
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, rank)
        if _should_compress(n, m, r, min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((i, n, m, r))
    return [entry for group in by_shape.values() for entry in group]


class PowerSGD(ContractDefaults, torch.optim.SGD):
    """Momentum SGD whose gradients DDP averages with torch's PowerSGD hook.

    Per parameter group (``torch.optim.SGD``'s): ``lr``, ``momentum``,
    ``dampening``, ``weight_decay``, ``nesterov``. For the exchange (torch's
    ``PowerSGDState`` settings): ``matrix_approximation_rank`` (r),
    ``start_powerSGD_iter`` (backward passes with plain all-reduce first; > 1
    when error feedback or warm start is on), ``min_compression_rate``,
    ``use_error_feedback``, ``warm_start``, ``orthogonalization_epsilon``;
    ``seed`` (Q's random initialisation, the same on every rank) and
    ``process_group``.

    Wrap the model with :func:`slamb.wrap_model`, which installs the hook of
    :meth:`ddp_comm_hook`. State is per rank (the error-feedback buffers):
    save and load one optimizer state per rank.
    """

    communication = OPTIMIZER_HOOK
    per_rank_state = True

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1000,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
        process_group=None,
        ledger: comm.CommLedger | None = None,
    ):
        check_range("lr", lr, 0.0)
        check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
        check_range("weight_decay", weight_decay, 0.0)
        check_count("matrix_approximation_rank", matrix_approximation_rank)
        check_choice("use_error_feedback", use_error_feedback, (True, False))
        check_choice("warm_start", warm_start, (True, False))
        low = 2 if use_error_feedback or warm_start else 0
        check_count("start_powerSGD_iter", start_powerSGD_iter,
                    " with use_error_feedback or warm_start (DDP rebuilds its buckets after the first backward), or "
                    "turn both off" if low else "", minimum=low)
        check_range("min_compression_rate", min_compression_rate, 0.0)
        check_range("orthogonalization_epsilon", orthogonalization_epsilon, 0.0)
        if not isinstance(seed, int):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov)
        check_process_group(process_group)
        self.process_group = process_group
        self.ledger = ledger or comm.CommLedger()
        self.powersgd = PowerSGDState(
            process_group=None, matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter, min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback, warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon, random_seed=seed)
        self._buckets: dict[int, list[int]] = {}  # DDP bucket index -> its parameters (positions in param_groups)
        self._loaded: dict | None = None  # per-parameter state, laid out for each bucket as it arrives
        self._backwards = 0  # backward passes since the last wrap
        self._relayout = False
        self._in_flight: torch.futures.Future | None = None  # the previous bucket's exchange

    def ddp_comm_hook(self):
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        self.powersgd.process_group = _RecordingGroup(group, self)
        self._backwards, self._in_flight = 0, None
        self._relayout = True  # a new DDP: its first buckets are not those of an earlier one
        return self, powersgd_comm_hook

    @torch.no_grad()
    def step(self, closure=None):
        """torch's SGD step, on fp32 copies of bf16 or fp16 parameters and gradients (its momentum is then
        fp32: in their dtype a momentum near 1 cannot decay), rounded once into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            sparse = self._init_group(group, params, grads, buffers)
            work = working_copies(params)
            sgd(work, working_copies(grads), buffers, has_sparse_grad=sparse, foreach=group["foreach"],
                fused=group["fused"], weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
            write_back_(params, work)
            if group["momentum"] != 0:
                for p, buf in zip(params, buffers):
                    self.state[p]["momentum_buffer"] = buf
        self.ledger.end_step()
        return loss

    # -- bucket layouts and checkpoints ---------------------------------------------------
    # torch keeps error feedback and the warm-start P and Q per DDP bucket. DDP cuts its buckets in
    # parameter order for its first backward, then again in the order the gradients arrived: a state
    # made under one cut must not meet the other (torch avoids it by starting PowerSGD after the first
    # backward, which a resumed run cannot). So at the first and the second backward of each DDP, and
    # in checkpoints, the state is held per parameter and each bucket's is assembled when the bucket
    # reaches the hook.

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _factors(self, members: list[int], params: list[torch.Tensor]):
        s = self.powersgd
        return factor_layout([params[i].shape for i in members], s.matrix_approximation_rank, s.min_compression_rate)

    def _enter_bucket(self, bucket: dist.GradBucket) -> None:
        s = self.powersgd
        if self._relayout:  # first bucket of a backward whose cut may differ from the last one's
            self._relayout = False
            self._loaded = self._per_parameter()
            s.error_dict, s.p_memory_dict, s.q_memory_dict = {}, {}, {}
            self._buckets = {}
        params = self._params()
        positions = {id(p): i for i, p in enumerate(params)}
        if any(id(p) not in positions for p in bucket.parameters()):
            raise ValueError("PowerSGD: the wrapped model trains a parameter this optimizer does not update: "
                             "create the optimizer with every trainable parameter of the model")
        index, members = bucket.index(), [positions[id(p)] for p in bucket.parameters()]
        self._buckets[index] = members
        if self._loaded is not None:
            error, qs, device = self._loaded["error"], self._loaded["q"], bucket.buffer().device
            if members and all(i in error for i in members):
                s.error_dict[index] = torch.cat([error[i] for i in members]).to(device)
            factors = self._factors(members, params)
            if factors and all(members[j] in qs for j, *_ in factors):
                s.q_memory_dict[index] = torch.cat([qs[members[j]] for j, *_ in factors]).to(device)
                # P is recomputed from Q before it is read; its presence (and size) makes the hook warm-start
                s.p_memory_dict[index] = torch.zeros(sum(n * r for _, n, _, r in factors), device=device,
                                                     dtype=s.q_memory_dict[index].dtype)
        if bucket.is_last():  # the backward's last bucket: every bucket has been laid out
            self._loaded = None
            self._backwards += 1
            self._relayout = self._backwards == 1

    def _per_parameter(self) -> dict:
        """The error feedback and warm-start Q of every parameter, from torch's per-bucket buffers."""
        out = {"error": {}, "q": {}} if self._loaded is None else {k: dict(v) for k, v in self._loaded.items()}
        s, params = self.powersgd, self._params()
        for index, members in self._buckets.items():
            if index in s.error_dict:
                numels = [params[i].numel() for i in members]
                out["error"].update(zip(members, (t.clone() for t in s.error_dict[index].split(numels))))
            if index in s.q_memory_dict:
                factors = self._factors(members, params)
                chunks = s.q_memory_dict[index].split([m * r for _, _, m, r in factors])
                out["q"].update((members[j], t.clone()) for (j, *_), t in zip(factors, chunks))
        return out

    def state_dict(self) -> dict:
        sd = super().state_dict()
        s = self.powersgd
        sd[_KEY] = {
            **rank_stamp(self.process_group),
            "iter": s.iter,
            "rng": s.rng.get_state(),
            **self._per_parameter(),
            "numel_before": s.total_numel_before_compression,
            "numel_after": s.total_numel_after_compression,
            "ledger": self.ledger.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict.get(_KEY)
        if saved is None:
            raise ValueError(f"not a PowerSGD state dict (no {_KEY!r} entry): it was saved by another optimizer")
        check_rank_stamp("PowerSGD", saved, self.process_group, reason="each worker keeps its own error feedback")
        params = self._params()
        if any(i >= len(params) or t.numel() != params[i].numel() for i, t in saved["error"].items()):
            raise ValueError("PowerSGD checkpoint was saved for a different model (parameter shapes differ)")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != _KEY})
        promote_state_(self)  # torch's loader casts the momentum to the parameters' dtype
        s = self.powersgd
        s.iter = int(saved["iter"])
        s.rng.set_state(saved["rng"])
        s.error_dict, s.p_memory_dict, s.q_memory_dict = {}, {}, {}
        s.total_numel_before_compression = int(saved["numel_before"])
        s.total_numel_after_compression = int(saved["numel_after"])
        # copies: torch's hook writes into Q in place, and the caller's checkpoint must stay as saved
        self._loaded = {k: {int(i): t.clone() for i, t in saved[k].items()} for k in ("error", "q")}
        self._buckets = {}
        self.ledger.load_state_dict(saved["ledger"])
