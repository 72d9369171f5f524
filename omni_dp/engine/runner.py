"""The model runner: turns a scheduler output into one talker call and sampled codes.

It sees token ids, positions and page ids only; it never touches the queues or the allocator.
"""

from __future__ import annotations

import torch

from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.model import DecodeGroup, FlatBatch, SequenceSlice, Talker
from omni_dp.engine.sampling import sample, uniform_for
from omni_dp.engine.scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, talker: Talker, kv_cache: KVCache, device: torch.device) -> None:
        self.talker = talker
        self.kv_cache = kv_cache
        self.device = device
        self.page_size = kv_cache.spec.page_size
        self.temperature = talker.cfg.temperature

    def build_batch(self, output: SchedulerOutput) -> FlatBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sequences: list[SequenceSlice] = []
        for item in output.scheduled:
            request = item.request
            start_pos = request.num_computed_tokens
            end_pos = start_pos + item.num_new_tokens
            row = len(input_ids)
            input_ids += request.token_ids(start_pos, end_pos)
            for pos in range(start_pos, end_pos):
                positions.append(pos)
                slots.append(request.pages[pos // self.page_size] * self.page_size
                             + pos % self.page_size)
            page_table = None
            if item.num_new_tokens > 1:
                page_table = torch.tensor(request.pages, dtype=torch.long, device=self.device)
            sequences.append(
                SequenceSlice(
                    start=row,
                    end=row + item.num_new_tokens,
                    context_len=end_pos,
                    page_table=page_table,
                )
            )

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return FlatBatch(
            input_ids=as_tensor(input_ids),
            positions=as_tensor(positions),
            slots=as_tensor(slots),
            sequences=sequences,
            decode=self._decode_group(output, sequences),
        )

    def _decode_group(
        self, output: SchedulerOutput, sequences: list[SequenceSlice]
    ) -> DecodeGroup | None:
        """Page tables of every one-token sequence, padded to the widest."""
        members = [
            (item.request, seq)
            for item, seq in zip(output.scheduled, sequences, strict=True)
            if seq.page_table is None
        ]
        if not members:
            return None
        widest = max(len(request.pages) for request, _ in members)
        table = torch.tensor(
            [request.pages + [0] * (widest - len(request.pages)) for request, _ in members],
            dtype=torch.long, device=self.device,
        )
        positions = torch.arange(widest * self.page_size, device=self.device)
        lengths = torch.tensor([seq.context_len for _, seq in members], device=self.device)
        return DecodeGroup(
            rows=torch.tensor([seq.start for _, seq in members], device=self.device),
            page_table=table,
            mask=(positions.unsqueeze(0) < lengths.unsqueeze(1))[:, None, None, :],
        )

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Run the talker on every scheduled request and sample its next code."""
        batch = self.build_batch(output)
        logits = self.talker(batch, self.kv_cache.k, self.kv_cache.v)
        uniforms = [
            uniform_for(item.request.seed, len(item.request.output_codes))
            for item in output.scheduled
        ]
        return sample(logits, self.temperature, uniforms)
