"""Swap or recompute: what the reference engine does with the KV of a sequence it preempts.

Chosen by name (``engine.preemption``) from `preemption_policies`:

- ``recompute``: drop the KV; the sequence is prefilled again when it resumes (what the engine's L0 and the
  tiers still hold of it is a hit then, like any request's prefix).
- ``swap``: copy its KV to L1 and back (`SchedulerConnector.swap_out`; recompute when L1 has no room).
- ``auto``: per sequence, the cheaper of the two by a cost in seconds of waiting, from rates the engine
  observes as it runs (`Rates`):

      recompute = unstored × prefill_s_per_token × (1 + others) + stored × load_s_per_token
      swap      = tokens × (swap_out_s_per_token + load_s_per_token) + SWAP_JOB_S

  ``tokens`` are the sequence's computed tokens, ``stored`` those the tiers already hold whole chunks of
  (a write-through store of its prompt: a recompute loads them, as a swap would), ``unstored`` the rest.
  A recompute runs on the engine's own forward: every other sequence in the batch and the queue waits
  for it (``others``), while a swap's copies run on the transfer threads beside the forward and only the
  swapped sequence waits for them. So a long sequence under a busy queue is swapped, and a short one, or
  one whose tokens are mostly stored already, is recomputed.

The rates are observed, never set: prefill time per token from the engine's steps (the slope of forward
seconds over tokens computed, `Rates.observe_step`), copy times per token from the connector's transfer statistics
(device → L1 and L1 → device, once `MIN_BLOCKS` blocks have moved each way; a prior from this machine
class's host copy rate until then).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tiercache.registry import Registry

SWAP_JOB_S = 2e-3              # a swap's fixed cost: two jobs through the connector (plan, copy, report), ~a step
PRIOR_COPY_S_PER_BYTE = 1 / 4e9    # each way, until observed: a host copy rate typical of this machine class
MIN_BLOCKS = 32                # a copy route's rate is taken once it has moved this many blocks
DECAY = 0.98                   # a step's weight in the prefill fit, per step since (about 50 steps' memory)


@dataclass(frozen=True, slots=True)
class Victim:
    """What the engine knows of a sequence it is about to preempt (plain data)."""
    tokens: int        # computed tokens it would lose
    stored: int        # of them, the tokens the tiers hold whole chunks of already
    others: int        # sequences running or waiting besides it: who a recompute keeps waiting


@dataclass(slots=True)
class Rates:
    """Seconds per token, observed by the engine as it runs (`observe_step`, `observe_copies`)."""
    kv_bytes_per_token: int
    prefill_s_per_token: float | None = None
    swap_out_s_per_token: float | None = None
    load_s_per_token: float | None = None

    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)    # decayed sums: n, x, y, xx, xy

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One forward that computed ``tokens`` in ``seconds``. A step costs a fixed part (every layer's
        launch, the sampler, a decode batch's reads) plus a part per token; a recompute adds tokens to steps
        that run anyway, so what it costs is the slope — fitted by least squares over the recent steps
        (weights decaying by `DECAY` a step), the mean per token until the steps have varied in size."""
        if tokens <= 0 or seconds <= 0:
            return
        fit = self._fit
        for i, v in enumerate((1.0, tokens, seconds, tokens * tokens, tokens * seconds)):
            fit[i] = fit[i] * DECAY + v
        n, x, y, xx, xy = fit
        var = xx / n - (x / n) ** 2
        slope = (xy / n - (x / n) * (y / n)) / var if var > 1.0 else 0.0
        self.prefill_s_per_token = slope if slope > 0 else y / x

    def observe_copies(self, routes: dict[str, tuple[float, int]], block_size: int, out: str, into: str) -> None:
        """The connector's copy routes (name → (busy seconds, blocks), summed over links): ``out`` is the
        route a swap-out takes (device → L1), ``into`` the one a swap-in and a load take (L1 → device)."""
        for name, attr in ((out, "swap_out_s_per_token"), (into, "load_s_per_token")):
            seconds, blocks = routes.get(name, (0.0, 0))
            if blocks >= MIN_BLOCKS and seconds > 0:
                setattr(self, attr, seconds / (blocks * block_size))

    def copy_s_per_token(self, measured: float | None) -> float:
        return measured if measured is not None else self.kv_bytes_per_token * PRIOR_COPY_S_PER_BYTE


class PreemptionPolicy(Protocol):
    def swap(self, victim: Victim, rates: Rates) -> bool:
        """Whether to swap ``victim``'s KV out (True) or drop it to be recomputed (False)."""


preemption_policies: Registry[type[PreemptionPolicy]] = Registry("preemption policy")


@preemption_policies.register("recompute")
class Recompute:
    def swap(self, victim: Victim, rates: Rates) -> bool:
        return False


@preemption_policies.register("swap")
class Swap:
    def swap(self, victim: Victim, rates: Rates) -> bool:
        return True


@preemption_policies.register("auto")
class ByCost:
    """The cheaper of swap and recompute for this sequence now (module docstring)."""

    def __init__(self) -> None:
        self.swapped = 0
        self.recomputed = 0

    @staticmethod
    def costs(victim: Victim, rates: Rates) -> tuple[float, float]:
        """(swap, recompute) in seconds of waiting; before any step was observed, recompute is free."""
        load = rates.copy_s_per_token(rates.load_s_per_token)
        out = rates.copy_s_per_token(rates.swap_out_s_per_token)
        prefill = rates.prefill_s_per_token or 0.0
        stored = min(victim.stored, victim.tokens)
        recompute = (victim.tokens - stored) * prefill * (1 + victim.others) + stored * load
        swap = victim.tokens * (out + load) + SWAP_JOB_S
        return swap, recompute

    def swap(self, victim: Victim, rates: Rates) -> bool:
        swap, recompute = self.costs(victim, rates)
        chosen = swap < recompute
        self.swapped += chosen
        self.recomputed += not chosen
        return chosen
