"""PNG plots for benchmark results (matplotlib, Agg backend, no display needed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def bar_compare(
    labels: Sequence[str],
    series: Mapping[str, Sequence[float]],
    title: str,
    xlabel: str,
    ylabel: str,
    path: Path,
) -> Path:
    """Grouped bars: one group per label, one bar per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, list(values), width=width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))])
    ax.set_xticklabels(list(labels))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return _save(fig, path)


def lines(
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    title: str,
    xlabel: str,
    ylabel: str,
    path: Path,
) -> Path:
    """One line with markers per series over the same x values."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        ax.plot(list(xs), list(values), marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend()
    return _save(fig, path)


def cdfs(series: Mapping[str, Sequence[float]], title: str, xlabel: str, path: Path) -> Path:
    """Empirical CDF of each sample (e.g. TTFTs of each server)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        ordered = sorted(values)
        if ordered:
            ys = [(i + 1) / len(ordered) for i in range(len(ordered))]
            ax.step(ordered, ys, where="post", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.legend()
    return _save(fig, path)


def stacked_service(
    times: Sequence[float], per_tenant: Mapping[str, Sequence[int]], title: str, path: Path
) -> Path:
    """Tokens served per tenant over time, stacked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    names = sorted(per_tenant)
    ax.stackplot(list(times), *[list(per_tenant[n]) for n in names], labels=names, step="post")
    ax.set_title(title)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("tokens per bin")
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def curves(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    path: Path,
    hline: float | None = None,
    log_x: bool = False,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line with markers per series, each over its own x values; optionally a dashed
    horizontal line (a target), a logarithmic x axis (a geometric sweep) and fixed y limits."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (xs, ys) in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=f"target {hline:g}")
    if log_x:
        ax.set_xscale("log", base=2)
        ticks = sorted({x for xs, _ in series.values() for x in xs})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    return _save(fig, path)
