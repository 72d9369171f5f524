"""The model runner: turns a scheduler output into one talker call and sampled codes.

It sees token ids, positions and page ids only; it never touches the queues or the allocator.

A step sends its inputs to the device in two copies (the integers, the sampling uniforms) that do
not make the host wait, and waits once: when it reads the sampled codes back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.model import DecodeGroup, FlatBatch, SequenceSlice, Talker
from omni_dp.engine.sampling import sample, uniform_for
from omni_dp.engine.scheduler import SchedulerOutput


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied there without making the host wait for the GPU.

    `torch.tensor(values, device=cuda)` copies from pageable memory, which blocks the host until
    the GPU has caught up. From pinned memory a non_blocking copy is only queued on the current
    stream. A fresh pinned tensor per call is cheap and safe: the caching host allocator reuses
    its blocks and records the copy's stream, so a block is not handed out again before its copy
    has run. On the CPU there is nothing to pin (a CPU-only torch cannot) and no copy is made.
    """
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pin).to(device, non_blocking=pin)


@dataclass(frozen=True)
class Segment:
    """Where one input lies in a `StepStaging` buffer, and its shape."""

    start: int
    end: int
    shape: tuple[int, ...]

    def of(self, staged: torch.Tensor) -> torch.Tensor:
        """This input as a view of the uploaded buffer."""
        return staged[self.start : self.end].view(self.shape)


class StepStaging:
    """A step's int64 inputs laid end to end in one host buffer, uploaded in one copy.

    One copy per input list would be one host-device wait each (about nine per step); here the
    talker's tensors are views of the single device copy that `upload` makes.
    """

    def __init__(self) -> None:
        self._values: list[int] = []

    def add(self, values: list[int], shape: tuple[int, ...] | None = None) -> Segment:
        """Append one input (flat values, row-major if `shape` is given)."""
        start = len(self._values)
        self._values += values
        return Segment(start, len(self._values), shape or (len(values),))

    def upload(self, device: torch.device) -> torch.Tensor:
        return upload(self._values, torch.long, device)


class ModelRunner:
    def __init__(self, talker: Talker, kv_cache: KVCache, device: torch.device) -> None:
        self.talker = talker
        self.kv_cache = kv_cache
        self.device = device
        self.page_size = kv_cache.spec.page_size
        self.temperature = talker.cfg.temperature

    def build_batch(self, output: SchedulerOutput) -> FlatBatch:
        staging = StepStaging()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        # (start row, end row, context length, page table or None) of each sequence
        spans: list[tuple[int, int, int, Segment | None]] = []
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
            page_table = staging.add(request.pages) if item.num_new_tokens > 1 else None
            spans.append((row, row + item.num_new_tokens, end_pos, page_table))
        ids_at = staging.add(input_ids)
        positions_at = staging.add(positions)
        slots_at = staging.add(slots)
        last_rows_at = staging.add([end - 1 for _, end, _, _ in spans])
        decode_at = self._stage_decode_group(output, spans, staging)

        staged = staging.upload(self.device)
        return FlatBatch(
            input_ids=ids_at.of(staged),
            positions=positions_at.of(staged),
            slots=slots_at.of(staged),
            last_rows=last_rows_at.of(staged),
            sequences=[
                SequenceSlice(start, end, context_len, None if table is None else table.of(staged))
                for start, end, context_len, table in spans
            ],
            decode=None if decode_at is None else self._decode_group(staged, *decode_at),
        )

    def _stage_decode_group(
        self,
        output: SchedulerOutput,
        spans: list[tuple[int, int, int, Segment | None]],
        staging: StepStaging,
    ) -> tuple[Segment, Segment, Segment] | None:
        """The one-token sequences' rows, context lengths and page tables padded to the widest."""
        members = [
            (item.request, start, context_len)
            for item, (start, _, context_len, table) in zip(output.scheduled, spans, strict=True)
            if table is None
        ]
        if not members:
            return None
        widest = max(len(request.pages) for request, _, _ in members)
        table: list[int] = []
        for request, _, _ in members:
            table += request.pages + [0] * (widest - len(request.pages))
        return (
            staging.add([start for _, start, _ in members]),
            staging.add([context_len for _, _, context_len in members]),
            staging.add(table, (len(members), widest)),
        )

    def _decode_group(
        self, staged: torch.Tensor, rows: Segment, lengths: Segment, table: Segment
    ) -> DecodeGroup:
        page_table = table.of(staged)
        # On the device from the uploaded lengths: a kernel, not another copy.
        positions = torch.arange(page_table.shape[1] * self.page_size, device=self.device)
        mask = positions.unsqueeze(0) < lengths.of(staged).unsqueeze(1)
        return DecodeGroup(rows=rows.of(staged), page_table=page_table, mask=mask[:, None, None, :])

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Run the talker on every scheduled request and sample its next code."""
        batch = self.build_batch(output)
        logits = self.talker(batch, self.kv_cache.k, self.kv_cache.v)
        uniforms = [
            uniform_for(item.request.seed, len(item.request.output_codes))
            for item in output.scheduled
        ]
        return sample(logits, self.temperature, upload(uniforms, torch.float64, self.device))
