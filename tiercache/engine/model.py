"""A Llama-style decoder over the paged KV pool: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Worker side. One forward runs a flat batch of tokens from many sequences (a
mix of prefill chunks and decodes). Each layer writes its new K/V into the
pool through ``slot_mapping`` (one indexed copy for the whole batch) and
attends over each sequence's cached context through its block table. Layer
hooks let a KV connector wait for a layer's load and save a layer's KV.

A hybrid model (`ModelConfig.layer_types`) has sliding-window layers, which
attend to the last ``sliding_window`` positions only, and linear-attention
layers: a gated linear recurrence whose state the pool keeps per block.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tiercache.arith import ceil_div
from tiercache.engine.config import ModelConfig
from tiercache.machine import core_cache_bytes
from tiercache.pool.kv_cache import PagedKVCache

# A tile of attention scores stays within one core's L2: larger tiles spill into the L3 that every core shares,
# which slows attention, and slows it more beside a second engine on another core.
ATTN_TILE_BYTES = min(max(core_cache_bytes(2), 256 << 10), 4 << 20)


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's part of a flat batch: rows ``start:end`` and its cached context after this step."""
    start: int
    end: int
    context_len: int
    block_table: torch.Tensor   # int64 block ids covering context_len tokens


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    seqs: Sequence[SeqSlice]
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset


class LayerHooks(Protocol):
    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary embeddings in the rotate-half convention used by Hugging Face Llama checkpoints."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)   # [N, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = cfg.sliding_window if cfg.layer_type(layer) == "sliding_attention" else 0
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, batch: AttentionBatch,
                kv: PagedKVCache, hooks: LayerHooks | None) -> torch.Tensor:
        n = x.shape[0]
        q = rotary(self.q_proj(x).view(n, self.num_heads, self.head_dim), positions)
        k = rotary(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if hooks is not None:
            hooks.before_layer(self.layer)    # this layer's loaded KV must be in place before we read it
        parts = kv.layer_parts(self.layer)    # per rank: [2, num_blocks, block_size, its kv_heads, head_dim]
        per_part = self.num_kv_heads // len(parts)
        for i, cache in enumerate(parts):
            heads = slice(i * per_part, (i + 1) * per_part)
            cache[0].view(-1, per_part, self.head_dim).index_copy_(0, batch.slot_mapping, k[:, heads].to(cache.dtype))
            cache[1].view(-1, per_part, self.head_dim).index_copy_(0, batch.slot_mapping, v[:, heads].to(cache.dtype))
        if hooks is not None:
            hooks.after_layer(self.layer)
        out = torch.empty_like(q)
        for s in batch.seqs:
            ctx = s.context_len
            keys = _gather_heads(parts, 0, s.block_table, self.num_kv_heads, self.head_dim)[:ctx]
            values = _gather_heads(parts, 1, s.block_table, self.num_kv_heads, self.head_dim)[:ctx]
            out[s.start:s.end] = _attend(q[s.start:s.end].float(), keys.float(), values.float(), self.window)
        return self.o_proj(out.reshape(n, -1))


class LinearAttention(nn.Module):
    """A gated linear recurrence over the hidden state: ``h_t = g_t * h_{t-1} + (1 - g_t) * u_t``, output
    ``o(h_t)``, with ``g = sigmoid(gate(x))`` and ``u = in(x)`` per channel. Its state after each block is kept
    in the pool's state row of that block (`PagedKVCache.state`): a sequence resumes at a block boundary from
    the row of the block before it, and within a block from that block's own row (the running state)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, batch: AttentionBatch,
                kv: PagedKVCache, hooks: LayerHooks | None) -> torch.Tensor:
        u = self.in_proj(x).float()
        z = self.gate_proj(x).float()                    # g = sigmoid(z), taken in log space
        if hooks is not None:
            hooks.before_layer(self.layer)
        states = kv.state(self.layer)
        bs = kv.block_size
        h_out = torch.empty_like(u)
        for s in batch.seqs:
            first = s.context_len - (s.end - s.start)      # the position of the sequence's first new token
            for block in range(first // bs, ceil_div(s.context_len, bs)):
                lo, hi = max(first, block * bs), min(s.context_len, (block + 1) * bs)
                rows = slice(s.start + lo - first, s.start + hi - first)
                h0 = _state_before(states, s.block_table, block, lo, bs)
                h = _recurrence(h0, z[rows], u[rows])
                states[s.block_table[block]] = h[-1]
                h_out[rows] = h
        if hooks is not None:
            hooks.after_layer(self.layer)
        return self.out_proj(h_out.to(x.dtype))


def _state_before(states: torch.Tensor, table: torch.Tensor, block: int, position: int, bs: int) -> torch.Tensor:
    """The recurrence's state before ``position`` (in ``block``): zeros at the start, the previous block's row at
    a block boundary, else this block's running row."""
    if position == 0:
        return torch.zeros(states.shape[-1], dtype=states.dtype, device=states.device)
    return states[table[block - 1] if position == block * bs else table[block]]


def _recurrence(h0: torch.Tensor, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``h_t = g_t * h_{t-1} + (1 - g_t) * u_t`` with ``g = sigmoid(z)``, for a block's rows at once:
    ``h_t = G_t h0 + sum_{s<=t} (G_t / G_s) (1 - g_s) u_s`` with ``G`` the running product of the gates, every
    ratio taken as the exp of a difference of log sums (at most 1: no overflow, however small a gate)."""
    log_g = F.logsigmoid(z).cumsum(0)                                  # [T, C]: log G_t
    rows = z.shape[0]
    ratio = (log_g.unsqueeze(1) - log_g.unsqueeze(0)).exp_()           # [t, s, C]: G_t / G_s
    ratio.mul_(torch.ones(rows, rows, dtype=torch.bool, device=z.device).tril_().unsqueeze(-1))
    return torch.einsum("tsc,sc->tc", ratio, torch.sigmoid(-z) * u) + log_g.exp() * h0


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Causal grouped-query attention of ``q`` (``[new, heads, head_dim]``, the last ``new`` positions of the
    context) over ``keys`` / ``values`` (``[ctx, kv_heads, head_dim]``); returns ``[new, heads, head_dim]``.
    Callers pass float32 (a half-precision model's scores and softmax are still taken in float32).

    Each KV head's query heads are stacked into one matrix product against its keys, so the keys are never
    repeated per query head, and a tile of query rows is scored only against the columns its last row sees (a
    fresh prompt's later keys are never multiplied by its earlier queries), the rest of them masked. Query rows
    go in tiles that keep the score matrix under ``ATTN_TILE_BYTES`` (a core's L2): a long prefill in one call
    page-faults large fresh temporaries per layer, and tiles larger than the core's own cache are paid for in
    the shared L3. This does less work than repeating the keys and calling SDPA with a boolean mask over the
    whole context, for a cold prompt and for a turn after a hit alike.
    """
    new, heads, head_dim = q.shape
    ctx, kv_heads, _ = keys.shape
    group = heads // kv_heads
    keys_t = keys.permute(1, 2, 0)                 # [kv, D, ctx]
    values = values.transpose(0, 1)                # [kv, ctx, D]
    scale = head_dim ** -0.5
    out = torch.empty_like(q)
    tile = max(1, ATTN_TILE_BYTES // (ctx * heads * q.element_size()))
    if window:
        return _attend_window(q, keys_t, values, ctx, window, tile, out)
    for lo in range(0, new, tile):
        rows = min(new, lo + tile) - lo
        seen = ctx - new + lo + rows                # columns the tile's last row sees: none after them is computed
        first_hidden = seen - rows + 1              # row i of the tile sees columns < first_hidden + i
        query = q[lo:lo + rows].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(query.reshape(kv_heads, group * rows, head_dim), keys_t[..., :seen]).mul_(scale)
        if rows > 1:
            hidden = torch.ones(rows, rows - 1, dtype=torch.bool).triu_()
            scores.view(kv_heads, group, rows, seen)[..., first_hidden:].masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[lo:lo + rows] = (torch.bmm(weights, values[:, :seen]).view(kv_heads, group, rows, head_dim)
                             .permute(2, 0, 1, 3).reshape(rows, heads, head_dim))
    return out


def _attend_window(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, ctx: int, window: int, tile: int,
                   out: torch.Tensor) -> torch.Tensor:
    """`_attend` for a sliding window: the query at position ``p`` sees the keys of positions ``p - window + 1 ..
    p``; each tile of rows is scored only against the columns some row of it sees."""
    new, heads, head_dim = q.shape
    kv_heads = keys_t.shape[0]
    group = heads // kv_heads
    for lo in range(0, new, tile):
        rows = min(new, lo + tile) - lo
        first_pos = ctx - new + lo                          # the tile's first row's position
        start, seen = max(0, first_pos - window + 1), first_pos + rows
        query = q[lo:lo + rows].view(rows, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        scores = torch.bmm(query.reshape(kv_heads, group * rows, head_dim), keys_t[..., start:seen])
        scores.mul_(head_dim ** -0.5)
        pos = torch.arange(first_pos, seen).unsqueeze(1)
        cols = torch.arange(start, seen).unsqueeze(0)
        scores.view(kv_heads, group, rows, seen - start).masked_fill_((cols > pos) | (cols <= pos - window),
                                                                     float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[lo:lo + rows] = (torch.bmm(weights, values[:, start:seen]).view(kv_heads, group, rows, head_dim)
                             .permute(2, 0, 1, 3).reshape(rows, heads, head_dim))
    return out


def _gather_heads(parts: list[torch.Tensor], kv: int, table: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """K (``kv=0``) or V of a sequence's blocks as ``[tokens, heads, head_dim]``, heads from every rank's part."""
    if len(parts) == 1:
        return parts[0][kv, table].reshape(-1, heads, head_dim)
    return torch.cat([p[kv, table] for p in parts], dim=-2).reshape(-1, heads, head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        linear = cfg.layer_type(layer) == "linear_attention"
        self.self_attn = LinearAttention(cfg, layer) if linear else Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, rotary, batch, kv, hooks):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, batch, kv, hooks)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Parameter names follow Hugging Face's LlamaForCausalLM so checkpoints load by name."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv: PagedKVCache,
        hooks: LayerHooks | None = None,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for ``logits_rows`` of the batch (default: every row)."""
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary, batch, kv, hooks)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.lm_head(self.norm(x)).float()
