"""Greedy or temperature sampling over a batch of logits rows."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tiercache.engine.sequence import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """One token per row; greedy rows take the argmax, others draw with a per-(seed, step) generator."""
    greedy = logits.argmax(dim=-1).tolist()
    out = []
    for i, p in enumerate(params):
        if p.temperature == 0:
            out.append(greedy[i])
            continue
        g = torch.Generator().manual_seed(p.seed * 1_000_003 + steps[i])
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out
