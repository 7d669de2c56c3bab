"""How `tiercache demo` shows its report: the summary and per-source tables on the terminal, and
demo.json, demo.md and demo.png with ``--out``."""
from __future__ import annotations

from pathlib import Path

from tiercache.bench.report import markdown_table, write_json

SUMMARY_KEYS = ("ttft_cold_ms_p50", "ttft_warm_ms_p50", "ttft_cold_ms_p99", "ttft_warm_ms_p99", "speedup_p50",
                "token_hit_ratio", "request_hit_ratio", "prefill_tokens_saved", "outputs_match")
SOURCE_COLUMNS = ("source", "requests", "TTFT p50 ms", "hit tokens", "chunks loaded", "MiB loaded", "load GB/s")


def print_report(report: dict, tiers: str) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = Table(title=f"demo: {report['workload']}, {report['requests']} requests, tiers {tiers}", min_width=64)
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    for key in SUMMARY_KEYS:
        summary.add_row(key, str(report[key]))
    summary.add_row("hit tokens from L0 / tiers",
                    f"{report['hit_tokens_by_tier']['l0']} / {report['hit_tokens_by_tier']['tiers']}")
    Console(width=max(80, Console().width)).print(summary)

    sources = Table(title="warm requests, by where their prefix came from", min_width=64)
    for col in SOURCE_COLUMNS:
        sources.add_column(col, justify="left" if col == "source" else "right")
    for row in _source_rows(report):
        sources.add_row(*("-" if v is None else str(v) for v in row))
    Console(width=max(100, Console().width)).print(sources)
    if report.get("kv_groups"):
        groups = Table(title="what a chunk and a resume point store, by KV-cache group", min_width=64)
        for col in ("group", "pages a block", "bytes a token (chunks)", "bytes a resume point"):
            groups.add_column(col, justify="left" if col == "group" else "right")
        for g in report["kv_groups"]:
            name = g["kind"] + (f" ({g['window_tokens']} tokens)" if g["window_tokens"] else "")
            groups.add_row(name, str(g["pages_per_block"]), str(g.get("bytes_per_token", "-")),
                           str(g.get("bytes_per_resume_point", "-")))
        Console(width=max(100, Console().width)).print(groups)


def _source_rows(report: dict) -> list[list[object]]:
    """One row per source that served a request or loaded a chunk, in `SOURCE_COLUMNS` order."""
    rows = []
    for source, r in report["by_source"].items():
        if not r["requests"] and not r.get("chunks_loaded"):
            continue
        mib = round(r["bytes_loaded"] / (1 << 20), 1) if "bytes_loaded" in r else None
        rows.append([source, r["requests"], r["ttft_ms_p50"], r.get("hit_tokens"), r.get("chunks_loaded"), mib,
                     r.get("load_gbps")])
    return rows


def write_files(out: Path, report: dict) -> None:
    """demo.json, demo.md and demo.png (TTFT p50 by where each request's prefix came from)."""
    write_json(out / "demo.json", report)
    rows = [["" if v is None else v for v in row] for row in _source_rows(report)]
    (out / "demo.md").write_text(
        f"# tiercache demo: {report['workload']}\n\n`{report['command']}`\n\n"
        f"Time to first token without a cache, p50: {report['ttft_cold_ms_p50']} ms; with tiercache, p50: "
        f"{report['ttft_warm_ms_p50']} ms. Warm requests by where their prefix came from:\n\n"
        + markdown_table(list(SOURCE_COLUMNS), rows))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    served = [row for row in rows if row[1]]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar([row[0] for row in served], [row[2] for row in served], color="tab:blue")
    ax.bar_label(bars, fmt="%.1f ms", padding=2)          # a warm bar is a small fraction of the cold one
    ax.axhline(report["ttft_cold_ms_p50"], linestyle="--", color="grey", label="no cache (p50)")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token, p50 (ms, log scale)")
    ax.set_title(f"tiercache demo ({report['workload']}): where each request's prefix came from")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)
    plt.close(fig)
