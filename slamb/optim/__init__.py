from .dgc import DGC
from .diloco import DiLoCo
from .jointspar import JointSpar
from .lamb import LAMB
from .onebit_lamb import OnebitLamb
from .powersgd import PowerSGD
from .slamb import SLAMB

__all__ = ["DGC", "DiLoCo", "JointSpar", "LAMB", "OnebitLamb", "PowerSGD", "SLAMB"]
