"""The vocoder: codec tokens → 24 kHz waveform, decoded in chunks as tokens arrive.

Every convolution is causal, so a sample depends only on a bounded number of earlier tokens
(`left_context_tokens`). A chunk is decoded together with that many tokens before it, and the
samples of the context are dropped: joins between chunks are seamless. Chunk boundaries are fixed
by token counts (not by timing), and the non-streamed response is decoded on the same boundaries,
so the streamed and non-streamed bytes of a request are identical.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from omni_dp.engine.config import ModelConfig, VocoderConfig

_OUTPUT_GAIN = 0.5  # headroom below full scale: random weights must not clip


class CausalConv1d(nn.Conv1d):
    """A Conv1d that pads on the left only: output t sees inputs t-(k-1)..t."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class Vocoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        vcfg: VocoderConfig = cfg.vocoder
        self.cfg = vcfg
        self.embed = nn.Embedding(cfg.codebook_size, vcfg.embed_dim)
        self.pre = CausalConv1d(vcfg.embed_dim, vcfg.embed_dim, 3)
        self.factors = vcfg.upsample_factors
        ins = (vcfg.embed_dim, *vcfg.channels[:-1])
        self.ups = nn.ModuleList(
            CausalConv1d(c_in, c_out, vcfg.kernel_size)
            for c_in, c_out in zip(ins, vcfg.channels, strict=True)
        )
        self.post = CausalConv1d(vcfg.channels[-1], 1, vcfg.kernel_size)
        self.left_context_tokens = self._receptive_field_tokens()

    def _receptive_field_tokens(self) -> int:
        """Tokens before a chunk that can influence its samples, rounded up with a margin."""
        lookback = 2.0  # `pre`, kernel 3, at the token rate
        rate = 1
        for factor in self.factors:
            rate *= factor
            lookback += (self.cfg.kernel_size - 1) / rate
        lookback += (self.cfg.kernel_size - 1) / rate  # `post`
        return math.ceil(lookback) + 1

    @torch.inference_mode()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes int64 [T] → samples float [T × samples_per_token] in [-0.5, 0.5]."""
        x = self.embed(codes).t().unsqueeze(0)
        x = F.silu(self.pre(x))
        for factor, conv in zip(self.factors, self.ups, strict=True):
            x = F.silu(conv(x.repeat_interleave(factor, dim=-1)))
        return torch.tanh(self.post(x)).squeeze(0).squeeze(0) * _OUTPUT_GAIN

    def decode_range(self, codes: list[int], start: int, end: int) -> torch.Tensor:
        """Samples of tokens [start, end), using up to `left_context_tokens` tokens before."""
        ctx_start = max(0, start - self.left_context_tokens)
        device = self.embed.weight.device
        # On CUDA from pinned memory, non_blocking: queued on the current stream, no host wait.
        pin = device.type == "cuda"
        window = torch.tensor(codes[ctx_start:end], dtype=torch.long, pin_memory=pin)
        samples = self(window.to(device, non_blocking=pin))
        return samples[(start - ctx_start) * self.cfg.samples_per_token :]


def quantize_pcm16(samples: torch.Tensor) -> torch.Tensor:
    """Float samples in [-1, 1] → int16, on the samples' device."""
    return (samples.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)


def pcm16_bytes(ints: torch.Tensor) -> bytes:
    """int16 samples → little-endian signed 16-bit PCM."""
    return ints.cpu().numpy().astype("<i2", copy=False).tobytes()


def to_pcm16(samples: torch.Tensor) -> bytes:
    """Float samples in [-1, 1] → little-endian signed 16-bit PCM."""
    return pcm16_bytes(quantize_pcm16(samples))


class ChunkSchedule:
    """Where a request's audio is cut: after `first` tokens, then every `every` tokens."""

    def __init__(self, first: int, every: int) -> None:
        self.first = first
        self.every = every

    def boundaries_between(self, done: int, available: int) -> list[int]:
        """Chunk ends in (done, available] — the chunks that can be decoded now."""
        ends = []
        end = self.first if done < self.first else done + self.every
        while end <= available:
            ends.append(end)
            end += self.every
        return ends


class VocoderStream:
    """One request's codes as they arrive, and the chunks of PCM they are ready to become."""

    def __init__(self, vocoder: Vocoder, schedule: ChunkSchedule) -> None:
        self.vocoder = vocoder
        self.schedule = schedule
        self.codes: list[int] = []
        self.num_decoded = 0

    def push(self, new_codes: list[int], finished: bool) -> list[bytes]:
        return [pcm16_bytes(chunk) for chunk in self.push_pcm(new_codes, finished)]

    def push_pcm(self, new_codes: list[int], finished: bool) -> list[torch.Tensor]:
        """Like `push`, with the chunks left on the vocoder's device as int16 samples."""
        self.codes.extend(new_codes)
        chunks = []
        for end in self.schedule.boundaries_between(self.num_decoded, len(self.codes)):
            samples = self.vocoder.decode_range(self.codes, self.num_decoded, end)
            chunks.append(quantize_pcm16(samples))
            self.num_decoded = end
        if finished and self.num_decoded < len(self.codes):
            tail = self.vocoder.decode_range(self.codes, self.num_decoded, len(self.codes))
            chunks.append(quantize_pcm16(tail))
            self.num_decoded = len(self.codes)
        return chunks


def decode_all(vocoder: Vocoder, codes: list[int]) -> np.ndarray:
    """Whole-utterance decode in one call; used to check that chunked decoding is seamless."""
    if not codes:
        return np.zeros(0, dtype=np.float32)
    samples = vocoder(torch.tensor(codes, dtype=torch.long, device=vocoder.embed.weight.device))
    return samples.float().cpu().numpy()
