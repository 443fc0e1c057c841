"""The benchmarks' figures: matplotlib off-screen, grouped bars and log-2 lines, one PNG per result set."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def figure(ncols: int = 1, size: tuple[float, float] = (6, 4)) -> tuple[Any, list[Any]]:
    """A figure of `ncols` axes side by side, drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=size, squeeze=False)
    return fig, list(axes[0])


def grouped_bars(ax: Any, groups: Sequence[str], series: dict[str, list[float]]) -> dict[str, list[float]]:
    """One bar per series in each group (groups along x, in order); returns each series' bar positions."""
    width = 0.8 / len(series)
    xs = {label: [j + i * width for j in range(len(groups))] for i, label in enumerate(series)}
    for label, values in series.items():
        ax.bar(xs[label], values, width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], list(groups))
    return xs


def log2_lines(ax: Any, lines: dict[str, tuple[list[float], list[float]]], xlabel: str) -> None:
    """One marked line per label over a log-2 x axis: `lines[label] = (xs, ys)`."""
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)


def save(fig: Any, path: Path | str) -> None:
    """The figure as a PNG at `path`, its memory freed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mode_bars(rows: list[list[Any]], path: Path, title: str) -> None:
    """Tokens/s per prompt, a bar per mode: `rows` of [mode, prompt, tok/s, ...]."""
    prompts = list(dict.fromkeys(r[1] for r in rows))
    modes = list(dict.fromkeys(r[0] for r in rows))
    rates = {(r[0], r[1]): r[2] for r in rows}
    fig, (ax,) = figure(size=(9, 4))
    grouped_bars(ax, prompts, {m: [rates[m, p] for p in prompts] for m in modes})
    ax.set_ylabel("tokens/s (c = 1)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    save(fig, path)
