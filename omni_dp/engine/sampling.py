"""Seeded sampling whose draws depend on (seed, step) only.

Each request's k-th draw uses a uniform number computed from its seed and k with a counter-based
generator, not from a stateful RNG: a request that is preempted and resumed, batched with others
or served by another replica consumes exactly the same random numbers as when it runs alone.
"""

from __future__ import annotations

import hashlib
import json

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One SplitMix64 output (Steele et al., 2014): a well-mixed 64-bit function of x."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, step: int) -> float:
    """A uniform number in [0, 1) for draw `step` of a request with `seed` (53 random bits)."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ step) >> 11) / float(1 << 53)


def derive_seed(fields: dict) -> int:
    """Default seed of a request: a hash of what it asks for, so equal requests sound equal."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "little") >> 1


def pick(
    logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | list[float]
) -> torch.Tensor:
    """Inverse-CDF sampling of one index per row of `logits` [rows, vocab], left on the
    logits' device: the caller reads them back (its one wait) after whatever it queues behind.

    The arithmetic is done in float64 on the logits' device so the CDF is not rounded to the
    model's dtype. `uniforms` (one per row) should already be a float64 tensor there, as the
    runner uploads them. A list is accepted too, and copied.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = torch.as_tensor(uniforms, dtype=torch.float64, device=logits.device).unsqueeze(1)
    picks = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    return picks.clamp_(max=logits.shape[-1] - 1)


def sample(
    logits: torch.Tensor, temperature: float, uniforms: torch.Tensor | list[float]
) -> list[int]:
    """`pick`, read back: with uploaded uniforms, reading the picks is the only wait."""
    return pick(logits, temperature, uniforms).tolist()
