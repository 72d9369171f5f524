"""The talker: a decoder-only transformer that reads a paged KV cache.

Plain torch: RMSNorm, rotary positions, grouped-query attention, gated (SwiGLU) MLP. The model
runs one flat batch of tokens from many sequences per call (prefill and decode mixed, no padding);
only attention looks at sequence boundaries, one sequence at a time, reading its keys and values
from the pages the scheduler gave it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omni_dp.engine.config import ModelConfig


@dataclass
class SequenceSlice:
    """One sequence's share of a flat batch."""

    start: int  # first row of the sequence's new tokens in the flat batch
    end: int  # one past its last row
    context_len: int  # tokens in the cache once this step's tokens are written
    # int64 [num_pages] pages holding positions 0..context_len-1; None for one-token sequences,
    # which the decode group covers.
    page_table: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Sequences with exactly one new token, attended in one padded call rather than a loop."""

    rows: torch.Tensor  # int64 [B] their rows in the flat batch
    page_table: torch.Tensor  # int64 [B, P] each one's pages, padded with page 0
    mask: torch.Tensor  # bool [B, 1, 1, P × page_size] True for real context, False for padding


@dataclass
class FlatBatch:
    """Everything the talker needs for one step; built by the model runner.

    The tensors are on the talker's device before the call: building one inside the forward
    would make the host wait for the GPU mid-step.
    """

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slots: torch.Tensor  # int64 [T] cache slot (page × page_size + offset) of each new token
    last_rows: torch.Tensor  # int64 [num_sequences] each sequence's last row: where logits are read
    sequences: list[SequenceSlice]  # every sequence, in row order
    decode: DecodeGroup | None = None  # the one-token sequences, if any


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables, indexed by absolute position (rotate-half convention)."""

    def __init__(self, head_dim: int, max_position: int, theta: float) -> None:
        super().__init__()
        # On the CPU whatever the default device (tables() moves them on first use): a model
        # built on the meta device (sizes, a weight-sharing follower) gets real tables too.
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64,
                                                 device=cpu) / head_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float64, device=cpu),
                             inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Plain attributes, not buffers: `model.to(bfloat16)` must not round the tables.
        self.cos = angles.cos()
        self.sin = angles.sin()

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, head_dim]; looked up once per step."""
        if self.cos.device != positions.device:
            self.cos, self.sin = self.cos.to(positions.device), self.sin.to(positions.device)
        cos = self.cos[positions].to(dtype).unsqueeze(1)
        sin = self.sin[positions].to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, heads, head_dim], rotated by the positions the tables were made for."""
        cos, sin = tables
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        batch: FlatBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size, _ = self.split
        # q and k are adjacent in the projection: rotate them in one go.
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = RotaryEmbedding.rotate(qk, rope).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        # Write this step's keys/values into their pages before reading: a sequence's new
        # tokens attend to themselves too.
        k_cache.flatten(0, 1)[batch.slots] = k.to(k_cache.dtype)
        v_cache.flatten(0, 1)[batch.slots] = v.to(v_cache.dtype)

        out = torch.empty_like(q)
        page_size = k_cache.shape[1]
        decode = batch.decode
        if decode is not None:
            # Whole pages at a time: [B, P, page, kvh, d] → [B, P × page, kvh, d].
            keys = k_cache[decode.page_table].flatten(1, 2).to(q.dtype)
            values = v_cache[decode.page_table].flatten(1, 2).to(q.dtype)
            attended = F.scaled_dot_product_attention(
                q[decode.rows].unsqueeze(2),  # [B, H, 1, d]
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=decode.mask,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[decode.rows] = attended.squeeze(2)
        for seq in batch.sequences:
            if seq.page_table is None:
                continue  # a one-token sequence: attended above, with the decode group
            n_pages = -(-seq.context_len // page_size)
            pages = seq.page_table[:n_pages]
            keys = k_cache[pages].flatten(0, 1)[: seq.context_len].to(q.dtype)
            values = v_cache[pages].flatten(0, 1)[: seq.context_len].to(q.dtype)
            query = q[seq.start : seq.end]
            num_new = seq.end - seq.start
            mask = None
            if num_new > 1:
                # Query i sits at position context_len - num_new + i and sees keys up to it.
                q_pos = torch.arange(seq.context_len - num_new, seq.context_len, device=x.device)
                k_pos = torch.arange(seq.context_len, device=x.device)
                mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            attended = F.scaled_dot_product_attention(
                query.transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=mask,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[seq.start : seq.end] = attended.transpose(0, 1)
        return self.o_proj(out.flatten(1))


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(self, x, batch, rope, k_cache, v_cache):
        x = x + self.attn(self.input_norm(x), batch, rope, k_cache, v_cache)
        return x + self.mlp(self.post_attn_norm(x))


class Talker(nn.Module):
    """Text + speaker tokens in, logits over codec codes (+ end-of-audio) out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.codebook_size + 1, bias=False)

    @torch.inference_mode()
    def forward(
        self, batch: FlatBatch, k_caches: torch.Tensor, v_caches: torch.Tensor
    ) -> torch.Tensor:
        """Return logits [num_sequences, codebook_size + 1] at each sequence's last new token."""
        x = self.embed(batch.input_ids)
        rope = self.rope.tables(batch.positions, x.dtype)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            x = layer(x, batch, rope, k_cache, v_cache)
        return self.lm_head(self.norm(x[batch.last_rows]))
