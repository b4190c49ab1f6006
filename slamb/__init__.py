"""SLAMB and its baselines over torch.distributed, with an exact byte ledger."""
from . import comm
from .amp import RankAgreedGradScaler
from .averaging import average_model, averaged_model
from .checkpoint import load_optimizer, load_sharded, save_optimizer, save_sharded
from .comm import CommLedger
from .contract import DistributedOptimizer, adopt
from .ddp import shard_model, wrap_model
from .optim import DGC, LAMB, SLAMB, DiLoCo, JointSpar, OnebitLamb, PowerSGD
from .registry import OPTIMIZERS, create_optimizer, param_groups_weight_decay

__version__ = "0.1.0"
__all__ = [
    "SLAMB", "LAMB", "OnebitLamb", "DGC", "JointSpar", "PowerSGD", "DiLoCo", "CommLedger", "comm", "wrap_model", "adopt", "DistributedOptimizer",
    "average_model", "averaged_model", "save_optimizer", "load_optimizer", "save_sharded", "load_sharded",
    "RankAgreedGradScaler",
    "create_optimizer", "OPTIMIZERS", "param_groups_weight_decay", "shard_model",
]
