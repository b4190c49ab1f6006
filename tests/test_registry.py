"""Every optimizer by name: builds, trains a small model under 2 workers, and keeps the ranks consistent."""
import pytest
import torch

import slamb
from slamb.contract import GRADIENT_ALLREDUCE, NO_DDP, OPTIMIZER_HOOK
from tests import distributed

SETTINGS = {  # enough for a small MLP to learn in a few dozen steps
    "sgd": dict(lr=0.1, momentum=0.9),
    "adamw": dict(lr=1e-2),
    "lamb": dict(lr=0.02),
    "slamb": dict(lr=0.02, compress_ratio=0.3, sync_interval=5, min_compress_numel=500),
    "onebit_lamb": dict(lr=0.02, freeze_step=10),
    "dgc": dict(lr=0.1, momentum=0.9, density=0.1, warmup_densities=()),
    "jointspar": dict(lr=0.1, momentum=0.9),
    "jointspar_lars": dict(lr=1.0, momentum=0.9),  # LARS scales the step by 0.001 ||w|| / ||g||
    "powersgd": dict(lr=0.1, momentum=0.9, matrix_approximation_rank=2, start_powerSGD_iter=5),
    "diloco": dict(lr=1e-2, sync_interval=5),  # 40 steps end on an outer step: the ranks agree
}


def make_task(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    torch.manual_seed(100 + rank)  # each rank has its own data
    x = torch.randn(64, 20)
    y = (x[:, :4] * torch.arange(1.0, 5.0)).argmax(1)
    return model, x, y


def train_worker(rank, world, names):
    out = {}
    for name in names:
        model, x, y = make_task(rank)
        opt = slamb.create_optimizer(name, model, weight_decay=1e-4, **SETTINGS[name])
        net = slamb.wrap_model(model, opt)
        losses = []
        for _ in range(40):
            opt.begin_step()
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if loss.requires_grad:
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        if hasattr(opt, "unfreeze"):
            opt.unfreeze()
        with torch.no_grad():
            final = float(torch.nn.functional.cross_entropy(model(x), y))
        out[name] = {"first": losses[0], "final": final, "bytes": opt.comm_stats()["total"]["all"]["payload"],
                     "params": [p.detach().clone() for p in model.parameters()],
                     "wrapped": net is not model, "kinds": set(opt.comm_stats()["total"]) - {"all"}}
    return out


@pytest.mark.multiprocess
def test_every_optimizer_trains_under_two_workers():
    assert set(SETTINGS) == set(slamb.OPTIMIZERS)
    res = distributed.run(train_worker, 2, sorted(SETTINGS))
    for name in SETTINGS:
        for r in res:
            assert r[name]["final"] < 0.7 * r[name]["first"], (name, r[name])
            assert r[name]["bytes"] > 0, name  # and it did communicate, through the ledger
        opt = slamb.create_optimizer(name, torch.nn.Linear(2, 2))
        # the DDP wrapping follows the declared communication; SLAMB's DDP sends no gradient at all
        assert res[0][name]["wrapped"] == (opt.communication != NO_DDP), name
        if opt.communication == GRADIENT_ALLREDUCE:
            assert "grads" in res[0][name]["kinds"], name
        if name == "slamb":
            # sampled entries of the two matrices, the biases averaged whole, the parameter syncs, the step decision
            assert res[0][name]["kinds"] == {"momentum", "momentum_dense", "params", "control"}, res[0][name]["kinds"]
        if not opt.params_differ:  # SLAMB's parameters agree only right after a sync step (tested elsewhere)
            for a, b in zip(res[0][name]["params"], res[1][name]["params"]):
                assert torch.equal(a, b), name


CONTRACT = {  # communication, params_differ, per_rank_state, state_averages
    "sgd": (GRADIENT_ALLREDUCE, False, False, False), "adamw": (GRADIENT_ALLREDUCE, False, False, False),
    "lamb": (GRADIENT_ALLREDUCE, False, False, False), "slamb": (OPTIMIZER_HOOK, True, True, True),
    "onebit_lamb": (OPTIMIZER_HOOK, False, True, False), "dgc": (OPTIMIZER_HOOK, False, True, False),
    "jointspar": (NO_DDP, False, False, False), "jointspar_lars": (NO_DDP, False, False, False),
    "powersgd": (OPTIMIZER_HOOK, False, True, False), "diloco": (OPTIMIZER_HOOK, True, True, False),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_optimizer_satisfies_the_contract(name):
    opt = slamb.create_optimizer(name, torch.nn.Linear(3, 3), **SETTINGS[name])
    assert isinstance(opt, slamb.DistributedOptimizer)
    assert (opt.communication, opt.params_differ, opt.per_rank_state, opt.state_averages) == CONTRACT[name]
    opt.begin_epoch(0)
    opt.begin_step()


def test_adopt_makes_any_torch_optimizer_data_parallel():
    opt = slamb.adopt(torch.optim.RMSprop(torch.nn.Linear(2, 2).parameters()))
    assert isinstance(opt, slamb.DistributedOptimizer) and opt.communication == GRADIENT_ALLREDUCE
    opt.step()
    assert opt.comm_stats()["steps"] == 1  # its ledger closes a step with each optimizer step
    opt.communication = "allgather"
    with pytest.raises(ValueError, match="invalid communication='allgather'"):
        slamb.adopt(opt)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown optimizer 'lars'.*'slamb'"):
        slamb.create_optimizer("lars", torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_unknown_setting_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['compress_rate'\].*valid: \["):
        slamb.create_optimizer(name, torch.nn.Linear(2, 2), compress_rate=0.1)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_name_builds_with_its_defaults_and_a_ledger(name):
    opt = slamb.create_optimizer(name, torch.nn.Linear(3, 3), weight_decay=0.01)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.comm_stats()["steps"] == 0
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.01]  # the bias goes to the group without weight decay
