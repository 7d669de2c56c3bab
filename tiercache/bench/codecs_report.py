"""Tables and report files of `tiercache bench codecs` (`tiercache.bench.codecs` measures)."""
from __future__ import annotations

from pathlib import Path

from tiercache.bench.report import markdown_table, write_json

SPEED = ("codec", "bytes vs raw", "encode GB/s", "decode GB/s", "encode / disk write", "decode / disk read")
ERROR = ("codec", "K/V", "rel L2 (mean over layers)", "rel L2 (worst layer)", "max abs")
ACCURACY = ("codec", "first token identical %", "sequence identical %", "mean |Δ logprob|", "max |Δ logprob|",
            "mean KL (nats)", "hit tokens / request", "disk chunks loaded")


def _speed_rows(report: dict) -> list[tuple]:
    return [(r["codec"], r["ratio"], "—" if r["codec"] == "raw" else r["encode_gbps"], r["decode_gbps"],
             "—" if r["codec"] == "raw" else r["encode_vs_disk_write"], r["decode_vs_disk_read"])
            for r in report["speed"]["codecs"]]


def _error_rows(rows: list[dict]) -> list[tuple]:
    return [(r["codec"], r["kv"], r["rel_l2_mean"], r["rel_l2_max"], r["max_abs"]) for r in rows]


def _accuracy_rows(report: dict) -> list[tuple]:
    return [(r["codec"], r["first_token_identical_pct"], r["sequence_identical_pct"], r["mean_abs_dlogprob"],
             r["max_abs_dlogprob"], r["mean_kl_nats"], r["hit_tokens_per_request"], r["disk_chunks_loaded"])
            for r in report["accuracy"]["results"]]


def _model_error(report: dict) -> list[dict]:
    from tiercache.bench.codecs import error_summary
    return error_summary(report["model_kv_error"])


def _sections(report: dict) -> list[tuple[str, tuple, list[tuple]]]:
    s = report["speed"]
    out = [(f"bytes and speed: one {s['chunk_tokens']}-token chunk of {s['shape']} ({s['dtype']}, "
            f"{s['codecs'][0]['chunk_bytes'] / 2**20:.0f} MiB); disk here: write {s['disk_write_gbps']} GB/s "
            f"(fdatasync), read {s['disk_read_gbps']} GB/s ({s['disk_reads']})", SPEED, _speed_rows(report)),
           ("KV reconstruction error, synthetic KV (K with outlier channels)", ERROR,
            _error_rows(report["synthetic_kv_error"]))]
    if "accuracy" in report:
        a = report["accuracy"]
        out.append((f"KV reconstruction error, the model's own KV ({report['model']['path']})", ERROR,
                    _error_rows(_model_error(report))))
        out.append((f"accuracy: {a['requests']} requests of ~{a['prompt_tokens']:.0f} tokens, {a['max_tokens']} greedy "
                    f"tokens, prefixes loaded from disk through the codec, against no tiers", ACCURACY,
                    _accuracy_rows(report)))
    return out


def codec_tables(report: dict) -> list:
    from rich.table import Table
    tables = []
    for title, headers, rows in _sections(report):
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*map(str, row))
        tables.append(table)
    return tables


def write_codec_reports(out: Path, report: dict) -> None:
    """codecs.json, codecs.md and (with matplotlib) codecs.png: bytes and GB/s per codec beside the disk."""
    write_json(out / "codecs.json", report)
    text = f"# Chunk codecs\n\n`{report.get('command', '')}`\n\n"
    for title, headers, rows in _sections(report):
        text += f"## {title}\n\n" + markdown_table(headers, rows) + "\n"
    (out / "codecs.md").write_text(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["speed"]["codecs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["codec"] for r in rows]
    left.bar(names, [r["ratio"] for r in rows])
    left.set_ylabel("stored bytes / raw bytes")
    width = 0.4
    xs = range(len(rows))
    right.bar([x - width / 2 for x in xs], [0 if r["codec"] == "raw" else r["encode_gbps"] for r in rows], width,
              label="encode")
    right.bar([x + width / 2 for x in xs], [r["decode_gbps"] for r in rows], width, label="decode")
    right.axhline(report["speed"]["disk_write_gbps"], linestyle="--", color="grey", label="disk write")
    right.axhline(report["speed"]["disk_read_gbps"], linestyle=":", color="black", label="disk read")
    right.set_xticks(list(xs), names)
    right.set_ylabel("GB/s of raw bytes")
    right.legend()
    fig.suptitle("Chunk codecs")
    fig.tight_layout()
    fig.savefig(out / "codecs.png", dpi=110)
    plt.close(fig)
