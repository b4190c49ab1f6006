from .dgc import DGC
from .lamb import LAMB
from .onebit_lamb import OnebitLamb
from .slamb import SLAMB

__all__ = ["DGC", "LAMB", "OnebitLamb", "SLAMB"]
