"""How `tiercache bench tiers` shows its report: the throughput table (and the codec table) on the terminal,
and tiers.json, tiers.md and tiers.png with ``--out``."""
from __future__ import annotations

from pathlib import Path

from tiercache.bench.report import markdown_table, write_json

REMOTE_VARIANTS = {"redis": "pipelined", "grpc": "data channel", "grpc-stream": "gRPC streams",
                   "grpc-shm": "shared-memory files"}
TABLE_COLUMNS = ("tier", "variant", "chunk", "put GB/s", "get GB/s", "raw put GB/s", "raw get GB/s", "put/raw",
                 "get/raw")


def codec_gains(runs: list[dict], base: str) -> list[dict]:
    """Per tier and codec: tokens/s put and got, and the gain over the ``base`` codec's run of that tier."""
    out = []
    tiered = [r for r in runs if "put_tokens_per_s" in r]
    for r in tiered:
        tier = r.get("tier", "disk")
        ref = next(x for x in tiered if x.get("tier", "disk") == tier and x["codec"] == base)
        out.append({"tier": tier, "codec": r["codec"], "put_tokens_per_s": r["put_tokens_per_s"],
                    "get_tokens_per_s": r["get_tokens_per_s"],
                    "put_gain": round(r["put_tokens_per_s"] / ref["put_tokens_per_s"], 3),
                    "get_gain": round(r["get_tokens_per_s"] / ref["get_tokens_per_s"], 3)})
    return out


def _row(tier: str, variant: str, r: dict, raw_put: float, raw_get: float) -> tuple[str, ...]:
    return (tier, variant, f"{r['chunk_bytes'] / 2**20:.1f} MiB", f"{r['put_gbps']:.2f}", f"{r['get_gbps']:.2f}",
            f"{raw_put:.2f}", f"{raw_get:.2f}", f"{r['put_ratio']:.2f}", f"{r['get_ratio']:.2f}")


def table_rows(report: dict, cpu_runs: int, remotes: list[str]) -> list[tuple[str, ...]]:
    """The terminal table's rows: each CPU layout, each remote tier, then the disk (first codec's runs)."""
    rows = []
    if "cpu" in report["tiers"]:
        rows += [_row("cpu", f"{r['block_layout']} blocks", r, r["raw_gbps"], r["raw_gbps"])
                 for r in report["runs"][:cpu_runs]]
    for kind in remotes:
        r = report["tiers"][kind]
        rows.append(_row(kind, REMOTE_VARIANTS[kind], r, r["raw_put_gbps"], r["raw_get_gbps"]))
    if "disk" in report["tiers"]:
        r = report["tiers"]["disk"]
        variant = ("O_DIRECT" if r["o_direct"] else "fsync" if r["fsync"] else "buffered") \
            + (", cold reads" if r["reads"].startswith("cold") else ", cached reads")
        rows.append(_row("disk", variant, r, r["raw_write_gbps"], r["raw_read_gbps"]))
    return rows


def print_tables(report: dict, title: str, cpu_runs: int, remotes: list[str], codecs: list[str]) -> None:
    """The throughput table, and with more than one codec the tokens/s each codec gains over the first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in TABLE_COLUMNS:
        table.add_column(col, justify="right")
    for row in table_rows(report, cpu_runs, remotes):
        table.add_row(*row)
    console = Console(width=max(110, Console().width))
    console.print(table)
    if len(codecs) > 1:
        gains = Table(title=f"tokens/s through each tier by codec, against {codecs[0]} in this run")
        for col in ("tier", "codec", "put tokens/s", "get tokens/s", "put gain", "get gain"):
            gains.add_column(col, justify="right")
        for g in report["codec_gains"]:
            gains.add_row(g["tier"], g["codec"], str(g["put_tokens_per_s"]), str(g["get_tokens_per_s"]),
                          f"{g['put_gain']:.2f}", f"{g['get_gain']:.2f}")
        console.print(gains)


def write_tier_reports(out: Path, report: dict) -> None:
    """tiers.json, tiers.md and tiers.png (tier and raw GB/s side by side) in ``out``."""
    write_json(out / "tiers.json", report)
    rows = []
    for r in report["runs"]:
        tier = "cpu" if "block_layout" in r else r.get("tier", "disk")
        variant = r.get("block_layout") or REMOTE_VARIANTS.get(tier) or ("fsync" if r.get("fsync") else "buffered")
        raw_put, raw_get = {"cpu": (r.get("raw_gbps"), r.get("raw_gbps")),
                            "disk": (r.get("raw_write_gbps"), r.get("raw_read_gbps"))}.get(
                                tier, (r.get("raw_put_gbps"), r.get("raw_get_gbps")))
        rows.append((tier, variant, r["put_gbps"], r["get_gbps"], raw_put, raw_get, r["put_ratio"], r["get_ratio"]))
    headers = ("tier", "variant", "put GB/s", "get GB/s", "raw put GB/s", "raw get GB/s", "put/raw", "get/raw")
    (out / "tiers.md").write_text(f"# Tier throughput\n\n`{report['command']}`\n\n" + markdown_table(headers, rows))
    _plot(out / "tiers.png", rows)


def _plot(path: Path, rows: list[tuple]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{t} {v}" for t, v, *_ in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (name, col) in enumerate((("put", 2), ("get", 3), ("raw put", 4), ("raw get", 5))):
        ax.bar([x + i * 0.2 for x in range(len(rows))], [row[col] for row in rows], 0.2, label=name)
    ax.set_xticks([x + 0.3 for x in range(len(rows))], labels)
    ax.set_ylabel("GB/s")
    ax.set_title("Tier throughput beside the raw limit (same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
