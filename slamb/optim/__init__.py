from .dgc import DGC
from .jointspar import JointSpar
from .lamb import LAMB
from .onebit_lamb import OnebitLamb
from .slamb import SLAMB

__all__ = ["DGC", "JointSpar", "LAMB", "OnebitLamb", "SLAMB"]
