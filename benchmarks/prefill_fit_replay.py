"""How well a router's prefill estimate predicts a replica's idle first tokens, replayed from `bench route` runs.

For each run of ``expected-ttft`` in the given ``tiercache bench route --json`` files (without a shared server),
each replica's requests that found it idle (no other request of its in flight from send to first token) are
taken in the order their first tokens arrived; each, after the first five, is predicted by a fit of those
before it, and the error is ``|predicted / actual - 1|``. Fits side by side:

- ``one rate``: the router before session 26 — the first rate measured, then an average (weight 0.2) of each
  new ``tokens / seconds``;
- ``two parts, absolute``: per token and per attended pair, least squares of the error in seconds;
- ``two parts, relative``: `tiercache.fleet.replicas.PrefillFit`, the router's fit.

    python benchmarks/prefill_fit_replay.py route-1.json route-2.json route-3.json
"""
from __future__ import annotations

import json
import statistics
import sys

from tiercache.fleet.replicas import PREFILL_DECAY, PrefillFit
from tiercache.fleet.routing import ReplicaRates

WARM = 5


class OneRate:
    def __init__(self) -> None:
        self.rate = 0.0

    def observe(self, n: int, c: int, s: float) -> None:
        self.rate = n / s if not self.rate else self.rate * 0.8 + 0.2 * n / s

    def predict(self, n: int, c: int) -> float:
        return n / self.rate


class Absolute:
    """Two parts, least squares of the error in seconds (the same decay and fallback as `PrefillFit`)."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5

    def observe(self, n: int, c: int, s: float) -> None:
        t, p = float(n), n * (c + n / 2)
        for i, v in enumerate((t * t, t * p, p * p, t * s, p * s)):
            self.sums[i] = self.sums[i] * PREFILL_DECAY + v

    def predict(self, n: int, c: int) -> float:
        tt, tp, pp, ty, py = self.sums
        det = tt * pp - tp * tp
        a, b = ((pp * ty - tp * py) / det, (tt * py - tp * ty) / det) if det > 0.05 * tt * pp else (0.0, 0.0)
        if a <= 0 or b <= 0:
            a, b = ty / tt, 0.0
        return n * a + n * (c + n / 2) * b


class Relative:
    def __init__(self) -> None:
        self.fit = PrefillFit()

    def observe(self, n: int, c: int, s: float) -> None:
        self.fit.observe(n, c, s)

    def predict(self, n: int, c: int) -> float:
        return self.fit.rates(ReplicaRates(1.0)).prefill_s(n, c)


FITS = {"one rate": OneRate, "two parts, absolute": Absolute, "two parts, relative": Relative}


def idle_first_tokens(records: list[dict]) -> dict[str, list[tuple[int, int, float]]]:
    """Per replica, (tokens computed, tokens cached, seconds) of its requests that found it idle, in order."""
    by_replica: dict[str, list[dict]] = {}
    for r in records:
        by_replica.setdefault(r["replica"], []).append(r)
    out = {}
    for name, rs in by_replica.items():
        idle = [r for r in rs if not any(o is not r and o["sent_s"] < r["sent_s"] + r["ttft_s"]
                                         and o["end_s"] > r["sent_s"] for o in rs)]
        idle.sort(key=lambda r: r["sent_s"] + r["ttft_s"])
        out[name] = [(r["prompt_tokens"] - r["cached_tokens"], r["cached_tokens"], r["ttft_s"])
                     for r in idle if r["prompt_tokens"] > r["cached_tokens"]]
    return out


def errors(samples: dict[str, list[tuple[int, int, float]]], fit: type) -> list[float]:
    out = []
    for seq in samples.values():
        f = fit()
        for i, (n, c, s) in enumerate(seq):
            if i >= WARM:
                out.append(abs(f.predict(n, c) / s - 1))
            f.observe(n, c, s)
    return out


def main(paths: list[str]) -> None:
    print("| run | replicas | first tokens predicted | " + " | ".join(f"{k}: median / p90" for k in FITS) + " |")
    print("| --- | ---: | ---: |" + " --- |" * len(FITS))
    for path in paths:
        for run in json.load(open(path))["runs"]:
            if run["shared_server"] or run["policy"] != "expected-ttft":
                continue
            samples = idle_first_tokens(run["records"])
            cells, predicted = [], 0
            for fit in FITS.values():
                e = sorted(errors(samples, fit))
                predicted = len(e)          # the same requests for every fit: each replica's after its fifth
                cells.append(f"{statistics.median(e):.3f} / {e[int(0.9 * (len(e) - 1))]:.3f}")
            print(f"| {path} | {run['replicas']} | {predicted} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
