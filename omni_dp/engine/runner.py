"""The model runner: turns a scheduler output into one talker call and sampled codes.

It sees token ids, positions and page ids only; it never touches the queues or the allocator.

A step sends its inputs to the device in two copies (the integers, the sampling uniforms) that do
not make the host wait, and waits once: when it reads the sampled codes back. On CUDA each step
is timed around that wait, without one of its own (engine/gpu_busy.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_dp.engine.gpu_busy import recorder_for
from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.model import DecodeGroup, FlatBatch, SequenceSlice, Talker
from omni_dp.engine.sampling import pick, uniform_for
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

    @property
    def values(self) -> list[int]:
        """Everything staged so far: what a tensor-parallel rank 0 sends the other ranks."""
        return self._values

    def upload(self, device: torch.device) -> torch.Tensor:
        return upload(self._values, torch.long, device)


# (start row, end row, context length, page table or None) of one sequence
Span = tuple[int, int, int, Segment | None]


@dataclass(frozen=True)
class BatchLayout:
    """Where each of a FlatBatch's inputs lies in the staged buffer.

    With the buffer, everything a batch is made of: plain ints, so that a tensor-parallel
    rank 0 can send both to the other ranks and each of them builds the same FlatBatch.
    """

    input_ids: Segment
    positions: Segment
    slots: Segment
    last_rows: Segment
    spans: list[Span]  # every sequence, in row order
    decode: tuple[Segment, Segment, Segment] | None  # one-token rows, context lengths, pages


def assemble_batch(staged: torch.Tensor, layout: BatchLayout, page_size: int) -> FlatBatch:
    """The FlatBatch whose inputs are views of `staged`, already on the talker's device."""
    decode = None
    if layout.decode is not None:
        rows, lengths, table = layout.decode
        page_table = table.of(staged)
        # On the device from the uploaded lengths: a kernel, not another copy.
        positions = torch.arange(page_table.shape[1] * page_size, device=staged.device)
        mask = positions.unsqueeze(0) < lengths.of(staged).unsqueeze(1)
        decode = DecodeGroup(rows=rows.of(staged), page_table=page_table,
                             mask=mask[:, None, None, :])
    return FlatBatch(
        input_ids=layout.input_ids.of(staged),
        positions=layout.positions.of(staged),
        slots=layout.slots.of(staged),
        last_rows=layout.last_rows.of(staged),
        sequences=[
            SequenceSlice(start, end, context_len, None if table is None else table.of(staged))
            for start, end, context_len, table in layout.spans
        ],
        decode=decode,
    )


class ModelRunner:
    def __init__(self, talker: Talker, kv_cache: KVCache, device: torch.device) -> None:
        self.talker = talker
        self.kv_cache = kv_cache
        self.device = device
        self.page_size = kv_cache.spec.page_size
        self.temperature = talker.cfg.temperature
        self.busy = recorder_for(device)  # the steps' GPU busy time (GET /gpu_busy)

    def build_batch(self, output: SchedulerOutput) -> FlatBatch:
        staging, layout = self.stage_batch(output)
        return assemble_batch(staging.upload(self.device), layout, self.page_size)

    def stage_batch(self, output: SchedulerOutput) -> tuple[StepStaging, BatchLayout]:
        """The step's inputs as host-side ints and where each lies: nothing touches the device."""
        staging = StepStaging()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[Span] = []
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
        layout = BatchLayout(
            input_ids=staging.add(input_ids),
            positions=staging.add(positions),
            slots=staging.add(slots),
            last_rows=staging.add([end - 1 for _, end, _, _ in spans]),
            spans=spans,
            decode=self._stage_decode_group(output, spans, staging),
        )
        return staging, layout

    def _stage_decode_group(
        self, output: SchedulerOutput, spans: list[Span], staging: StepStaging
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

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Run the talker on every scheduled request and sample its next code."""
        staging, layout = self.stage_batch(output)
        self.busy.begin()  # staged on the host: from here the step queues device work
        batch = assemble_batch(staging.upload(self.device), layout, self.page_size)
        return self.sample_codes(output, self.talker(batch, self.kv_cache.k, self.kv_cache.v))

    def sample_codes(self, output: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        """Each scheduled request's next code from its row of `logits`; ends the step."""
        uniforms = [
            uniform_for(item.request.seed, len(item.request.output_codes))
            for item in output.scheduled
        ]
        picks = pick(logits, self.temperature, upload(uniforms, torch.float64, self.device))
        self.busy.end()  # the step's last kernel is queued
        codes = picks.tolist()  # the step's one wait
        self.busy.synced()
        return codes
