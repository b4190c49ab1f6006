"""JointSpar and JointSpar-LARS (Liu & Mozafari, ICML 2022): joint
sparsification of computation and communication by layer sampling.

Round t (one optimizer step), identical on every worker:

1. ``opt.sample_round()``, before the forward pass: each layer d is active with
   probability p_d, drawn from a CPU generator seeded with (seed, t), so every
   rank (and every device type) draws the same layers without sending them and
   torch's global RNG is untouched. Inactive layers get ``requires_grad=False``
   and ``grad=None``: autograd computes no gradient for them.
2. forward and ``backward()`` on the plain (NOT DDP-wrapped) model;
3. ``opt.step()``: the active layers' gradients are averaged with ONE
   all-reduce of a packed buffer (kind ``"grads"``, 4 bytes per active fp32
   element; inactive layers send nothing); then the update of
   :func:`jointspar_reference`; then the distribution update of
   :func:`update_distribution` from the averaged gradients' layer norms.

The training loop::

    opt = create_optimizer("jointspar_lars", model, lr=..., weight_decay=...)
    for x, y in loader:
        opt.sample_round()          # same draw on every rank; freezes the rest
        loss = loss_fn(model(x), y)
        if loss.requires_grad:      # False in a round where no layer is active
            loss.backward()
        opt.step()
        opt.zero_grad()
    opt.unfreeze()                  # give every layer requires_grad=True back

Choices the paper leaves open, made here:

* a layer is a parameter tensor (a weight and its bias are sampled
  independently): the finest unit autograd can skip, and the unit of LARS's
  trust ratio;
* ``kappa`` is the budget as a fraction of the D layers: sum_d p_d = kappa*D
  expected active layers, with ``p_min <= p_d <= 1``; p starts uniform
  (p_d = kappa);
* the update estimates the dense direction u_d of each layer without bias:
  u_d = phi_d (g_d + wd w_d) with g_d the averaged gradient, phi_d = 1 (JointSpar)
  or the LARS trust ratio ``trust_coeff*||w_d|| / (||g_d|| + wd*||w_d||)``
  (JointSpar-LARS; 1 for 1-D tensors when ``lars_exclude_1d``). Active layers
  contribute u_d / p_d. The trust ratio is computed on the unscaled g_d and the
  1/p_d applied after it: a trust ratio of g_d/p_d would cancel the rescaling,
  and a layer sampled with probability p_d would move, in expectation, only
  p_d times as far as dense LARS moves it;
* heavy-ball momentum on that sparse estimate, m = mu m + u/p (u/p = 0 for
  inactive layers), w -= lr m: the momentum of an inactive layer decays by mu
  and the layer still moves along it. m stays an unbiased estimate of the
  dense momentum, is identical on every rank, and costs no communication;
* the distribution update (Algorithm 1 of the paper, as published: an
  exponentiated-gradient step on the bandit feedback of the layer norms):
  the loss of round t is the second moment of the sparse estimate,
  l_t(p) = sum_d a_d^2 / p_d, with a_d the norm of layer d's averaged gradient,
  minimised by p_d proportional to a_d (capped at 1, floored at p_min). Only
  active layers are observed, so the gradient -a_d^2/p_d^2 is replaced by its
  importance-weighted estimate -Z_d a_d^2/p_d^3 (Z_d = 1 if active), which is
  unbiased and 0 for inactive layers; see :func:`update_distribution` for the
  step size normalisation and the projection;
* every rank updates p from the all-reduced gradients, which are bitwise equal
  everywhere, with the same float64 CPU arithmetic, so p, hence the next draw,
  agrees without any communication.

Communication the optimizer does besides the gradients: at the first round
(of a fresh run) a 24-byte check that every rank holds the same layers (kind
``"control"``) and the broadcast of rank 0's parameters (kind ``"params"``),
the job DDP does for other optimizers. Buffers (BatchNorm statistics) are not
synchronised: they stay per rank.

Why no DDP: its reducer expects a gradient for every parameter at every step,
and with ``find_unused_parameters`` it all-reduces a map of the used ones (bytes
outside the ledger). ``communication = "no_ddp"`` makes :func:`slamb.wrap_model` return
the plain model, and ``ddp_comm_hook`` raises a clear error for code that would
wrap it anyway.
"""
from __future__ import annotations

import math

import torch
from torch.optim import Optimizer

from .. import comm
from ..contract import NO_DDP, ContractDefaults
from .checks import NONFINITE_POLICIES, check_choice, check_lr, check_process_group, check_range, nonfinite_skip
from .flat import FlatLayout, check_layouts_agree, param_labels
from .lamb_math import safe_ratio
from .masks import step_seed
from .precision import promote_state_, state_dtype, working_copies, write_back_


# -- the sampling distribution --------------------------------------------------------------------


def project_capped(log_weights: torch.Tensor, budget: float, floor: float, cap: float = 1.0) -> torch.Tensor:
    """Bregman (KL) projection of ``exp(log_weights)`` onto {sum p = budget, floor <= p <= cap}.

    The KL projection of positive weights w is p = clip(c w, floor, cap) with
    the unique c that meets the budget. f(c) = sum clip(c w) is non-decreasing
    and linear between the 2D breakpoints floor/w_i, cap/w_i, so c is found
    exactly (O(D log D), no iteration): evaluate f at every breakpoint with
    sorted w and prefix sums, then interpolate on the segment holding the
    budget. Needs D*floor <= budget <= D*cap.
    """
    w = torch.exp(log_weights - log_weights.max()).clamp_min(torch.finfo(log_weights.dtype).tiny)
    n = w.numel()
    ws = w.sort().values
    prefix = torch.cat([ws.new_zeros(1), ws.cumsum(0)])
    c = torch.cat([floor / w, cap / w]).sort().values
    n_lo = torch.searchsorted(ws, floor / c, right=True)  # w_i <= floor/c: at the floor
    n_hi = n - torch.searchsorted(ws, cap / c, right=False)  # w_i >= cap/c: at the cap
    f = floor * n_lo.to(w.dtype) + cap * n_hi.to(w.dtype) + c * (prefix[n - n_hi] - prefix[n_lo])
    f = torch.cummax(f, 0).values  # rounding must not break the ordering searchsorted needs
    k = torch.searchsorted(f, f.new_tensor([budget])).clamp_(1, c.numel() - 1)
    f0, f1, c0, c1 = f[k - 1], f[k], c[k - 1], c[k]
    t = torch.where(f1 > f0, (budget - f0) / torch.where(f1 > f0, f1 - f0, 1.0), 0.0).clamp_(0.0, 1.0)
    return (c0 + t * (c1 - c0)).mul(w).clamp_(floor, cap)


def update_distribution(prob: torch.Tensor, active: torch.Tensor, norms: torch.Tensor, *, budget: float,
                        p_min: float, lr: float) -> torch.Tensor:
    """One exponentiated-gradient step of the layer distribution from bandit feedback.

    ``prob`` (float64, D): this round's probabilities; ``active`` (bool, D):
    this round's draw Z; ``norms`` (D): a_d, the norm of layer d's averaged
    gradient (read only where active). Returns the next round's probabilities.

    * loss l(p) = sum_d a_d^2 / p_d; importance-weighted gradient estimate
      G_d = Z_d a_d^2 / p_d^3 (minus sign dropped: the step raises p_d);
    * step size: G is divided by L/budget, with L = sum_d Z_d a_d^2 / p_d^2 the
      same round's importance-weighted estimate of l(p). This makes ``lr``
      scale-free (the gradient scale changes by orders of magnitude during
      training) and gives sum_d p_d G_d = budget: the normalised gradient is 1
      per unit of budget on average, and 1 in expectation for every layer
      strictly between the bounds at the optimum p_d proportional to a_d;
    * log q = log p + lr * G, then :func:`project_capped` onto
      {sum = budget, p_min <= p <= 1} (the Bregman projection that matches
      the exponentiated gradient).

    A round with nothing observed (no active layer, all-zero or non-finite
    norms) leaves p unchanged. ``lr = 0`` keeps p as it is.
    """
    if lr == 0:
        return prob
    a2 = torch.where(active, norms.to(prob.dtype), 0.0).square()
    weighted = a2 / prob.square()
    total = weighted.sum()
    if not (math.isfinite(total) and total > 0):
        return prob
    gain = weighted / prob * (budget / total)
    return project_capped(prob.log() + lr * gain, budget, p_min)


# -- the update ---------------------------------------------------------------------------------


def jointspar_reference(p, g, m, *, prob, lr, momentum, wd, trust_coeff):
    """One layer's step, written out. ``g``: its averaged gradient when active
    this round, ``None`` when inactive; ``trust_coeff``: ``None`` for plain SGD
    (JointSpar, or a tensor LARS leaves out)."""
    m.mul_(momentum)
    if g is not None:
        u = g + wd * p
        if trust_coeff is not None:
            w_norm = p.norm()
            u = u * safe_ratio(trust_coeff * w_norm, g.norm() + wd * w_norm, 1.0)
        m.add_(u, alpha=1.0 / prob)
    p.sub_(lr * m)


class JointSpar(ContractDefaults, Optimizer):
    """JointSpar (``lars=False``) and JointSpar-LARS (``lars=True``) over torch.distributed.

    Per parameter group: ``lr``, ``momentum``, ``weight_decay``. For the whole
    optimizer (they shape the draw or the collective): ``kappa`` (budget,
    fraction of layers in (0, 1]), ``p_min`` (floor of every p_d, in
    (0, kappa]: a layer with p_d = 0 would make the estimate biased),
    ``dist_lr`` (step of the distribution update, >= 0; 0 keeps uniform
    sampling), ``lars``, ``trust_coeff`` (LARS's eta), ``lars_exclude_1d``
    (trust ratio 1 for biases and norm weights), ``seed``, ``process_group``.

    The layers are the parameters with ``requires_grad=True`` at construction,
    all on one device with one dtype; the others are never touched. Call
    :meth:`sample_round` before the forward pass of every step (see the module
    docstring for the loop); do not wrap the model in DDP.

    ``foreach=False`` runs :func:`jointspar_reference` layer by layer; the
    default fast path does the same math with ``torch._foreach_*``.

    ``nonfinite`` (``"raise"`` | ``"skip"`` | ``"ignore"``): what a step does
    when the averaged gradients hold NaN/inf. They are the same on every rank,
    so the decision is local and costs no collective.

    Settings of the reference code (the paper; the schedule is the training loop's):
    lr 0.1 with linear scaling, 5 warm-up epochs of 90, x0.1 at epochs 30, 50,
    70, local batch 1024. In simulations with fixed layer norms,
    ``dist_lr=0.003`` brings the variance within 5% of its optimum in about
    300 rounds; 0.01 is three times faster but oscillates when the budget is
    small (kappa*D = 16 of 160 layers, p_min = 0.01).
    """

    communication = NO_DDP  # slamb.wrap_model returns the plain model

    def __init__(
        self,
        params,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        kappa: float = 0.5,
        p_min: float = 0.05,
        dist_lr: float = 0.003,
        lars: bool = False,
        trust_coeff: float = 0.001,
        lars_exclude_1d: bool = True,
        seed: int = 0,
        process_group=None,
        foreach: bool | None = None,
        nonfinite: str = "raise",
        ledger: comm.CommLedger | None = None,
    ):
        check_range("kappa", kappa, 0.0, 1.0, lo_open=True)
        check_range("p_min", p_min, 0.0, kappa, lo_open=True)
        check_range("trust_coeff", trust_coeff, 0.0, lo_open=True)
        check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        for name, flag in (("lars", lars), ("lars_exclude_1d", lars_exclude_1d)):
            if not isinstance(flag, bool):
                raise ValueError(f"invalid {name}={flag!r}: must be True or False")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"invalid seed={seed!r}: must be an integer")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.kappa = float(kappa)
        self.p_min = float(p_min)
        self.dist_lr = dist_lr
        self.lars = lars
        self.trust_coeff = float(trust_coeff)
        self.lars_exclude_1d = lars_exclude_1d
        self.seed = seed
        check_process_group(process_group)
        self.process_group = process_group
        self.foreach = True if foreach is None else foreach
        self.nonfinite = nonfinite
        self.ledger = ledger or comm.CommLedger()

        everything = [p for g in self.param_groups for p in g["params"]]
        ids = [i for i, p in enumerate(everything) if p.requires_grad]
        if not ids:
            raise ValueError("JointSpar: no parameter has requires_grad=True: there is no layer to sample")
        self._layout = FlatLayout.of(self, ids)  # one device, one dtype
        self._layers = self._layout.params
        self._names = param_labels(self, ids)
        self._norm_dtype = state_dtype(self._layout.dtype)  # half precision: fp32 norms
        self._trusted = [not (lars_exclude_1d and p.dim() <= 1) for p in self._layers]
        self._prob = torch.full((len(self._layers),), self.kappa, dtype=torch.float64)
        self._round = 0
        self._active: torch.Tensor | None = None
        self._active_idx: list[int] = []

    # -- settings -----------------------------------------------------------------------------

    @property
    def dist_lr(self) -> float:
        return self._dist_lr

    @dist_lr.setter
    def dist_lr(self, value: float) -> None:
        check_range("dist_lr", value, 0.0)
        self._dist_lr = float(value)

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def budget(self) -> float:
        """Expected number of active layers per round: sum_d p_d."""
        return self.kappa * self.num_layers

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_layers", None) is not None:
            raise RuntimeError("JointSpar samples a fixed set of layers: add parameter groups before construction ends")
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        check_lr(g["lr"])
        check_range("momentum", g["momentum"], 0.0, 1.0, hi_open=True)
        check_range("weight_decay", g["weight_decay"], 0.0)

    # -- inspection ---------------------------------------------------------------------------

    def probabilities(self) -> torch.Tensor:
        """p_d of the next draw (float64, CPU, layer order)."""
        return self._prob.clone()

    def ddp_comm_hook(self):
        """Only reached by code that wraps the model in DDP despite ``communication = "no_ddp"``."""
        raise RuntimeError(
            "JointSpar averages the active layers' gradients itself and freezes the others each round, which "
            "DDP's reducer cannot follow: do not wrap the model in DDP. Use the plain model, call "
            "opt.sample_round() before each forward pass (the optimizer broadcasts the initial parameters "
            "from rank 0 at the first round)"
        )

    # -- rounds -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The contract's per-step schedule: :meth:`sample_round`."""
        self.sample_round()

    def sample_round(self) -> torch.Tensor:
        """Draw this round's active layers and freeze the others; call before the forward pass.

        Every rank must call it at the same points: at the first round of a
        fresh run it checks that the ranks hold the same layers (kind
        ``"control"``) and broadcasts rank 0's parameters (kind ``"params"``).
        Returns the draw (bool, layer order).
        """
        if self._round == 0:
            check_layouts_agree([self._layout], ledger=self.ledger, group=self.process_group, who="JointSpar")
            self._broadcast_params()
        self._round += 1
        gen = torch.Generator().manual_seed(step_seed(self.seed, self._round))
        self._set_active(torch.rand(self.num_layers, generator=gen, dtype=torch.float64) < self._prob)
        return self._active.clone()

    def unfreeze(self) -> None:
        """``requires_grad=True`` on every layer again (after training, or to use the model elsewhere)."""
        for p in self._layers:
            p.requires_grad_(True)
        self._active, self._active_idx = None, []

    def _set_active(self, active: torch.Tensor) -> None:
        self._active = active
        self._active_idx = torch.nonzero(active).flatten().tolist()
        for p, on in zip(self._layers, active.tolist()):
            p.requires_grad_(on)
            if not on:
                p.grad = None

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        if comm.world_size(self.process_group) == 1:
            return
        src = torch.distributed.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        flat = self._layout.flatten(self._layers)
        comm.broadcast_(flat, src, kind="params", ledger=self.ledger, group=self.process_group)
        torch._foreach_copy_(self._layers, self._layout.views(flat))

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["jointspar"] = {
            "round": self._round,
            "prob": self._prob.clone(),
            "active": None if self._active is None else self._active.clone(),
            "num_layers": self.num_layers,
            "kappa": self.kappa,
            "p_min": self.p_min,
            "seed": self.seed,
            "ledger": self.ledger.state_dict(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        extra = state_dict.get("jointspar")
        if extra is None:
            raise ValueError("not a JointSpar state dict (no 'jointspar' entry): it was saved by another optimizer")
        if extra["num_layers"] != self.num_layers:
            raise ValueError(f"JointSpar checkpoint has {extra['num_layers']} layers, this optimizer "
                             f"{self.num_layers}: build the same model before loading")
        if (extra["kappa"], extra["p_min"]) != (self.kappa, self.p_min):
            raise ValueError(f"JointSpar checkpoint has kappa={extra['kappa']}, p_min={extra['p_min']}; this "
                             f"optimizer kappa={self.kappa}, p_min={self.p_min}: construct it with the saved ones")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "jointspar"})
        promote_state_(self)  # torch's loader casts the momentum to the parameters' dtype
        self._round = int(extra["round"])
        # the sampling runs on the CPU (a host decision: which layers train), whatever device saved it
        self._prob = extra["prob"].to("cpu", torch.float64, copy=True)
        self.seed = int(extra["seed"])
        self.ledger.load_state_dict(extra["ledger"])
        if extra["active"] is None:
            self.unfreeze()
        else:
            self._set_active(extra["active"].to("cpu", torch.bool, copy=True))

    # -- the step -----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        if self._active is None:
            raise RuntimeError("JointSpar.step(): no round drawn; call opt.sample_round() before the forward "
                               "pass of every step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layers, idx = self._layers, self._active_idx
        for p in layers:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=self._norm_dtype)
        # An active layer the forward did not use has no gradient: it counts as
        # zero so that every rank packs the same buffer.
        grads = [layers[i].grad if layers[i].grad is not None else torch.zeros_like(layers[i]) for i in idx]
        averaged: list[torch.Tensor] = []
        if idx:
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce_mean_(flat, kind="grads", ledger=self.ledger, group=self.process_group)
            flat = flat.to(self._norm_dtype)  # bf16 or fp16 gradients: the update in fp32
            shapes = [layers[i].shape for i in idx]
            averaged = [v.view(s) for v, s in zip(torch.split(flat, [layers[i].numel() for i in idx]), shapes)]
        if nonfinite_skip(averaged, [self._names[i] for i in idx], self.nonfinite, ledger=None,
                          where="JointSpar: ", agree=False):
            self.nonfinite_skips += 1
            self._active, self._active_idx = None, []
            self.ledger.end_step()
            return loss

        g_norms = torch._foreach_norm(averaged, dtype=self._norm_dtype) if idx else []
        where = {i: k for k, i in enumerate(idx)}  # layer -> position among the active ones
        for gi, lo, hi in self._layout.groups:
            group, members = self.param_groups[gi], range(lo, hi)
            hyper = dict(lr=group["lr"], momentum=group["momentum"], wd=group["weight_decay"])
            if self.foreach:
                self._update_foreach(members, averaged, g_norms, where, **hyper)
            else:
                work = working_copies([layers[i] for i in members])
                for i, w in zip(members, work):
                    k = where.get(i)
                    jointspar_reference(w, None if k is None else averaged[k],
                                        self.state[layers[i]]["momentum_buffer"], prob=float(self._prob[i]),
                                        trust_coeff=self.trust_coeff if self.lars and self._trusted[i] else None,
                                        **hyper)
                write_back_([layers[i] for i in members], work)

        if idx and self.dist_lr > 0:
            # The one host sync of the step: the next draw, a decision every
            # rank takes on the host, depends on these norms.
            norms = torch.zeros(self.num_layers, dtype=torch.float64)
            norms[idx] = torch.stack(g_norms).to("cpu", torch.float64)
            self._prob = update_distribution(self._prob, self._active, norms, budget=self.budget,
                                             p_min=self.p_min, lr=self.dist_lr)
        self._active, self._active_idx = None, []
        self.ledger.end_step()
        return loss

    def _update_foreach(self, members, averaged, g_norms, where, *, lr, momentum, wd) -> None:
        layers = self._layers
        params = [layers[i] for i in members]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_mul_(bufs, momentum)
        on = [i for i in members if i in where]
        if on:
            u = [averaged[where[i]] for i in on]  # our own buffer: safe to overwrite
            if wd != 0:
                torch._foreach_add_(u, [layers[i] for i in on], alpha=wd)
            trusted = [i for i in on if self._trusted[i]] if self.lars else []
            if trusted:
                w_norms = torch.stack(torch._foreach_norm([layers[i] for i in trusted], dtype=self._norm_dtype))
                trust = safe_ratio(self.trust_coeff * w_norms,
                                   torch.stack([g_norms[where[i]] for i in trusted]) + wd * w_norms, 1.0)
                torch._foreach_mul_([averaged[where[i]] for i in trusted], list(trust.unbind()))
            torch._foreach_mul_(u, [1.0 / float(self._prob[i]) for i in on])
            torch._foreach_add_([bufs[i - members[0]] for i in on], u)
        torch._foreach_add_(params, bufs, alpha=-lr)
