"""The results pages' figures finish alike: matplotlib without a display, grid, legend, wrapped titles, 120 dpi."""
from __future__ import annotations

from pathlib import Path

def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrapped_title(ax, name: str, what: str, width_in: float) -> None:
    """``what`` over the page's name, wrapped to the axes' figure: a long name must not run off a small plot."""
    import textwrap

    chars = max(20, int(width_in * 13))  # about 13 characters of 9-point text per inch
    ax.set_title("\n".join([*textwrap.wrap(name, chars, break_long_words=True), what]), fontsize=9)


def save_png(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def save_figure(fig, axes, path: Path, *, legend_size: int = 8) -> Path:
    """Every page's curves finish alike: grid, legend, tight layout, 120 dpi PNG."""
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    return save_png(fig, path)
