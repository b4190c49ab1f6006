from .lamb import LAMB
from .slamb import SLAMB

__all__ = ["LAMB", "SLAMB"]
