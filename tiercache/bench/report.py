"""Benchmark report files: JSON, a Markdown table and (when matplotlib is installed) a PNG plot."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank; 0.0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_lines(
    path: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    hline: tuple[str, float] | None = None,
    beside: tuple[str, dict[str, tuple[Sequence[float], Sequence[float]]]] | None = None,
) -> bool:
    """One line per series; ``beside``: a second panel on the right over the same x (its y label, its series).
    False when matplotlib is missing (the JSON and Markdown still tell everything)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(ylabel, series)] + ([beside] if beside else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
    for ax, (label, lines) in zip(axes[0], panels):
        for name, (xs, ys) in lines.items():
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if hline is not None:
        axes[0][0].axhline(hline[1], linestyle="--", color="grey", label=hline[0])
    axes[0][0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], min_width: int) -> None:
    """``rows`` under ``headers`` as a right-aligned rich table on the terminal, at least ``min_width`` wide."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*map(str, row))
    Console(width=max(min_width, Console().width)).print(table)
