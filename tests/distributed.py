"""Multi-process tests run their bodies through the package's local launcher."""
from harness.local import run_local as run

__all__ = ["run"]
