"""How `tiercache bench trace` shows its report: one row per policy and capacity on the terminal, and
trace.json, trace.md and trace.png with ``--out``."""
from __future__ import annotations

from pathlib import Path

from tiercache.bench.report import markdown_table, plot_lines, write_json

BELADY_ROW = "belady (offline)"   # `replay_belady`: reads the trace's future; the headroom every policy has


def against_lru(results: list[dict]) -> None:
    """Give each row its token hit ratio over LRU's at the same capacity (and codec), where LRU was run."""
    lru = {(r["capacity_tokens"], r.get("codec")): r["token_hit_ratio"] for r in results if r["policy"] == "lru"}
    for r in results:
        base = lru.get((r["capacity_tokens"], r.get("codec")))
        if base:
            r["vs_lru"] = round(r["token_hit_ratio"] / base, 3)


def headers(by_bytes: bool, l1: int | None) -> tuple[str, ...]:
    lead = ("codec", "capacity (bytes)") if by_bytes else ()
    capacity = "capacity (tokens)" if l1 is None else f"L2 tokens (L1 {l1})"
    writes = "chunk writes" if l1 is None else "L2 chunk writes"
    return (*lead, "policy", capacity, "token hit ratio", "vs lru", writes, "request hit ratio")


def rows(results: list[dict], by_bytes: bool) -> list[tuple]:
    return [(*((r["codec"], f"{r['capacity_bytes'] / 2**30:g} GiB") if by_bytes else ()), r["policy"],
             r["capacity_tokens"], r["token_hit_ratio"], r.get("vs_lru", "-"), r["written_chunks"],
             r["request_hit_ratio"])
            for r in results]


def write_trace_reports(out: Path, report: dict, by_bytes: bool) -> None:
    """trace.json, trace.md and trace.png (hits and writes against capacity, a line per policy) in ``out``."""
    results, l1 = report["results"], report["l1_tokens"]
    write_json(out / "trace.json", report)
    (out / "trace.md").write_text(f"# Trace replay: {report['trace']}\n\nCeiling (infinite capacity): token hit "
                                  f"ratio {report['ceiling_token_hit_ratio']}\n\n"
                                  + markdown_table(headers(by_bytes, l1), rows(results, by_bytes)))
    x, label = ("capacity_bytes", "capacity (bytes)") if by_bytes else ("capacity_tokens", "capacity (tokens)")
    lines = list(dict.fromkeys((r["policy"], r.get("codec", "")) for r in results))

    def series(y: str) -> dict[str, tuple[list, list]]:
        return {" ".join(filter(None, k)): ([r[x] for r in results if (r["policy"], r.get("codec", "")) == k],
                                            [r[y] for r in results if (r["policy"], r.get("codec", "")) == k])
                for k in lines}
    writes = headers(by_bytes, l1)[-2]
    plot_lines(out / "trace.png", f"Hits and writes vs capacity ({Path(report['trace']).name})", label,
               "token hit ratio", series("token_hit_ratio"),
               ("infinite capacity", report["ceiling_token_hit_ratio"]), beside=(writes, series("written_chunks")))
