"""How `tiercache bench engine` shows its report: a row per workload and setup (or, with ``--preemption``, per
workload and mode) on the terminal, and engine.json, engine.md and engine.png with ``--out``."""
from __future__ import annotations

from pathlib import Path

from tiercache.bench.report import markdown_table, write_json

HEADERS = ("workload", "setup", "TTFT p50 ms", "TTFT p99 ms", "tok/s", "token hits", "request hits",
           "tokens saved", "matches")


def rows(results: list[dict]) -> list[tuple]:
    return [(r["workload"], r["setup"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["throughput_tok_s"],
             r["token_hit_ratio"], r["request_hit_ratio"], r["prefill_tokens_saved"], r["outputs_match_baseline"])
            for r in results]


def preemption_headers(first_mode: str) -> tuple[str, ...]:
    return ("workload", "preemption", "TTFT p50 ms", "TTFT p99 ms", "tok/s", "preemptions", "swapped",
            f"outputs = {first_mode}'s")


def preemption_rows(results: list[dict]) -> list[tuple]:
    return [(r["workload"], r["mode"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["throughput_tok_s"], r["preemptions"],
             r["swap_outs"], r["outputs_match"]) for r in results]


def write_engine_reports(out: Path, report: dict) -> None:
    """engine.json, engine.md and engine.png (TTFT p50 by workload and setup) in ``out``."""
    write_json(out / "engine.json", report)
    (out / "engine.md").write_text("# Engine benchmark\n\n" + markdown_table(HEADERS, rows(report["results"])))
    _plot(out / "engine.png", report["results"])


def write_preemption_reports(out: Path, report: dict, first_mode: str, reps: int) -> None:
    """engine.json and engine.md of a ``--preemption`` run in ``out``."""
    write_json(out / "engine.json", report)
    (out / "engine.md").write_text(f"# Preemption under memory pressure (medians of {reps})\n\n"
                                   + markdown_table(preemption_headers(first_mode),
                                                    preemption_rows(report["results"])))


def _plot(path: Path, results: list[dict]) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    workloads = list(dict.fromkeys(r["workload"] for r in results))
    setups = list(dict.fromkeys(r["setup"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(setups)
    for i, setup in enumerate(setups):
        values = [next((r["ttft_ms_p50"] for r in results if r["workload"] == w and r["setup"] == setup), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=setup)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    ax.set_title("Time to first token by tier setup")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
