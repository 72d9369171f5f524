"""What keeps the CUDA path from waiting on itself, checked on the CPU.

A talker step must send its integers to the device in one copy and its uniforms in another, and
build nothing from host lists on the device besides (each such tensor is a copy that makes the
host wait for the GPU). The batch it builds must hold exactly what the plain per-list way builds,
with the same logits and codes. The vocoder worker must deliver the bytes the plain per-chunk
decode gives.
"""

import pytest
import torch

import omni_dp.engine.runner as runner_module
from omni_dp.engine.config import PRESETS
from omni_dp.engine.core import StepOutputs, VocoderWorker
from omni_dp.engine.kv_cache import KVCache, plan_kv_cache
from omni_dp.engine.model import DecodeGroup, FlatBatch, SequenceSlice, Talker
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.sampling import sample, uniform_for
from omni_dp.engine.scheduler import (
    RequestOutput,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
    TalkerRequest,
)
from omni_dp.engine.vocoder import ChunkSchedule

from support.talker import CFG, PAGE  # the same small talker and page size as test_model


@pytest.fixture(scope="module")
def talker():
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4321)
        return Talker(CFG).eval()


def make_runner(talker, num_pages):
    spec = plan_kv_cache(
        num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim,
        dtype=torch.float32, page_size=PAGE, max_total_tokens=num_pages * PAGE,
    )
    return ModelRunner(talker, KVCache(spec, torch.device("cpu")), torch.device("cpu"))


def prompt_ids(length, offset=0):
    return [CFG.first_speaker_id + offset % CFG.num_speakers, CFG.bos_text_id,
            *[(13 * i + 7 + offset) % 256 for i in range(length - 2)]]


def make_request(request_id, prompt, seed):
    return TalkerRequest(request_id, list(prompt), 40, seed, CFG.first_code_id)


# --- the plain way: one tensor per list, as the runner used to build them ---------------


def reference_batch(output: SchedulerOutput) -> FlatBatch:
    input_ids, positions, slots, sequences = [], [], [], []
    for item in output.scheduled:
        request = item.request
        start = request.num_computed_tokens
        row = len(input_ids)
        input_ids += request.token_ids(start, start + item.num_new_tokens)
        for pos in range(start, start + item.num_new_tokens):
            positions.append(pos)
            slots.append(request.pages[pos // PAGE] * PAGE + pos % PAGE)
        table = torch.tensor(request.pages) if item.num_new_tokens > 1 else None
        sequences.append(
            SequenceSlice(row, row + item.num_new_tokens, start + item.num_new_tokens, table)
        )
    decoding = [
        (item.request, seq)
        for item, seq in zip(output.scheduled, sequences, strict=True)
        if seq.page_table is None
    ]
    decode = None
    if decoding:
        widest = max(len(request.pages) for request, _ in decoding)
        lengths = torch.tensor([seq.context_len for _, seq in decoding])
        decode = DecodeGroup(
            rows=torch.tensor([seq.start for _, seq in decoding]),
            page_table=torch.tensor(
                [request.pages + [0] * (widest - len(request.pages)) for request, _ in decoding]
            ),
            mask=(torch.arange(widest * PAGE)[None, :] < lengths[:, None])[:, None, None, :],
        )
    return FlatBatch(
        input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions),
        slots=torch.tensor(slots),
        last_rows=torch.tensor([seq.end - 1 for seq in sequences]),
        sequences=sequences,
        decode=decode,
    )


def uploaded_tensors(batch: FlatBatch) -> list[torch.Tensor]:
    """Every tensor of the batch made from host integers (the decode mask is made on the device)."""
    tensors = [batch.input_ids, batch.positions, batch.slots, batch.last_rows]
    tensors += [seq.page_table for seq in batch.sequences if seq.page_table is not None]
    if batch.decode is not None:
        tensors += [batch.decode.rows, batch.decode.page_table]
    return tensors


def assert_same_batch(batch: FlatBatch, reference: FlatBatch) -> None:
    for name in ("input_ids", "positions", "slots", "last_rows"):
        got, want = getattr(batch, name), getattr(reference, name)
        assert got.dtype == want.dtype == torch.long, name
        assert torch.equal(got, want), name
    assert len(batch.sequences) == len(reference.sequences)
    for got, want in zip(batch.sequences, reference.sequences, strict=True):
        assert (got.start, got.end, got.context_len) == (want.start, want.end, want.context_len)
        assert (got.page_table is None) == (want.page_table is None)
        if want.page_table is not None:
            assert got.page_table.dtype == torch.long
            assert torch.equal(got.page_table, want.page_table)
    assert (batch.decode is None) == (reference.decode is None)
    if reference.decode is not None:
        for name in ("rows", "page_table", "mask"):
            got, want = getattr(batch.decode, name), getattr(reference.decode, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name


class StepSpy:
    """Counts the runner's uploads, and tensors built on a device straight from host data.

    The check resets `uploads` and `built_on_device` before each step it executes.
    """

    def __init__(self, monkeypatch) -> None:
        self.steps = 0  # steps checked
        self.uploads = 0
        self.built_on_device: list[str] = []
        upload = runner_module.upload

        def counting_upload(*args, **kwargs):
            self.uploads += 1
            return upload(*args, **kwargs)

        monkeypatch.setattr(runner_module, "upload", counting_upload)
        for name in ("tensor", "as_tensor"):
            monkeypatch.setattr(torch, name, self._watch(name, getattr(torch, name)))

    def _watch(self, name, build):
        def watched(data, *args, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                self.built_on_device.append(name)
            return build(data, *args, **kwargs)

        return watched


def check_step(runner, output, spy):
    """The step's batch equals the plain one; its logits and codes too. Returns its codes."""
    batch = runner.build_batch(output)
    reference = reference_batch(output)
    assert_same_batch(batch, reference)
    storages = {t.untyped_storage().data_ptr() for t in uploaded_tensors(batch)}
    assert len(storages) == 1, "every uploaded input must be a view of the one step buffer"
    k, v = runner.kv_cache.k, runner.kv_cache.v
    # The same keys/values are written to the same slots by each call: the order is free.
    reference_logits = runner.talker(reference, k, v)
    assert torch.equal(runner.talker(batch, k, v), reference_logits)

    spy.uploads, spy.built_on_device = 0, []
    codes = runner.execute(output)
    assert spy.uploads == 2, "one upload of integers, one of uniforms"
    assert spy.built_on_device == []
    spy.steps += 1
    uniforms = [
        uniform_for(item.request.seed, len(item.request.output_codes))
        for item in output.scheduled
    ]
    assert codes == sample(reference_logits, runner.temperature, uniforms)
    return codes


# --- tests -------------------------------------------------------------------------------


def test_scheduled_steps_upload_once_and_match_the_plain_batch(talker, monkeypatch):
    spy = StepSpy(monkeypatch)
    # A pool small enough that requests are preempted and recomputed beside decoding ones.
    runner = make_runner(talker, num_pages=14)
    scheduler = Scheduler(
        runner.kv_cache.spec, end_of_audio=CFG.end_of_audio, max_running_requests=4
    )
    arrivals = {0: [("a", 9, 1), ("b", 5, 2)], 2: [("c", 14, 3)], 5: [("d", 3, 4)]}
    kinds = set()
    for step in range(40):
        for request_id, length, seed in arrivals.get(step, []):
            scheduler.add_request(make_request(request_id, prompt_ids(length, seed), seed))
        output = scheduler.schedule()
        if output.is_empty:
            break
        kinds.add(tuple(sorted({min(item.num_new_tokens, 2) for item in output.scheduled})))
        scheduler.update_from_output(output, check_step(runner, output, spy))
    assert kinds >= {(1,), (2,), (1, 2)}  # decode only, prefill only, and mixed steps
    assert scheduler.num_preemptions_total > 0
    assert spy.steps > 20


def test_chunked_prefill_beside_decodes_uploads_once_and_matches_the_plain_batch(
    talker, monkeypatch
):
    spy = StepSpy(monkeypatch)
    runner = make_runner(talker, num_pages=16)
    a = make_request("a", prompt_ids(13), seed=5)
    b = make_request("b", prompt_ids(6, offset=2), seed=6)
    c = make_request("c", prompt_ids(10, offset=4), seed=7)
    a.pages, b.pages, c.pages = [9, 2, 14, 0], [5, 11, 12], [3, 7, 1]
    # a in three parts (with a one-token part) while b and c prefill and decode beside it.
    steps = [[(a, 6), (b, 6)], [(b, 1), (a, 1), (c, 10)], [(a, 6), (b, 1), (c, 1)],
             [(c, 1), (a, 1), (b, 1)]]
    for items in steps:
        output = SchedulerOutput([ScheduledRequest(r, n) for r, n in items], [])
        codes = check_step(runner, output, spy)
        for (request, n), code in zip(items, codes, strict=True):
            request.num_computed_tokens += n
            if request.num_computed_tokens >= len(request.prompt_ids):
                request.output_codes.append(code % CFG.codebook_size)
    assert spy.steps == len(steps)


def test_sample_takes_the_uniforms_as_a_tensor_or_a_list():
    logits = torch.randn(50, 9, generator=torch.Generator().manual_seed(3))
    uniforms = [uniform_for(11, k) for k in range(50)]
    as_list = sample(logits, 0.7, uniforms)
    assert sample(logits, 0.7, torch.tensor(uniforms, dtype=torch.float64)) == as_list
    assert len(set(as_list)) > 3


# --- the vocoder worker ------------------------------------------------------------------

VOCODER_CFG = PRESETS["tiny"]
SPT = VOCODER_CFG.vocoder.samples_per_token


def plain_chunks(vocoder, codes):
    """Each chunk decoded with its left context and quantised on its own, as the worker used to."""
    first, every = VOCODER_CFG.vocoder.first_chunk_tokens, VOCODER_CFG.vocoder.chunk_tokens
    ends = list(range(first, len(codes) + 1, every)) if len(codes) >= first else []
    if not ends or ends[-1] < len(codes):
        ends.append(len(codes))
    chunks, start = [], 0
    for end in ends:
        context = max(0, start - vocoder.left_context_tokens)
        samples = vocoder(torch.tensor(codes[context:end]))[(start - context) * SPT :]
        ints = (samples.float().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
        chunks.append(ints.numpy().astype("<i2").tobytes())
        start = end
    return chunks


def test_vocoder_worker_delivers_the_plain_per_chunk_bytes(vocoder):
    generator = torch.Generator().manual_seed(8)
    first, every = VOCODER_CFG.vocoder.first_chunk_tokens, VOCODER_CFG.vocoder.chunk_tokens
    lengths = {"short": first - 1, "boundary": first + every, "long": first + 3 * every + 5}
    codes = {
        rid: torch.randint(0, VOCODER_CFG.codebook_size, (n,), generator=generator).tolist()
        for rid, n in lengths.items()
    }
    delivered = {rid: [] for rid in codes}
    failures = []
    worker = VocoderWorker(
        vocoder, ChunkSchedule(first, every),
        deliver=lambda rid, chunk, done: delivered[rid].append((chunk, done)),
        on_fatal=failures.append,
    )
    assert worker.cuda_stream is None  # on the CPU: the plain path
    # Queued before the thread starts, so the first batch merges many steps, later ones fewer.
    for step in range(max(lengths.values())):
        outputs = []
        for rid, request_codes in codes.items():
            if step < len(request_codes):
                last = step == len(request_codes) - 1
                status = RequestStatus.FINISHED_LENGTH if last else RequestStatus.RUNNING
                outputs.append(RequestOutput(rid, request_codes[step], status))
        worker.inbox.put(StepOutputs(outputs))
        if step == 7:
            worker.start()
    worker.stop()
    assert failures == []
    for rid, request_codes in codes.items():
        expected = [(chunk, False) for chunk in plain_chunks(vocoder, request_codes)]
        assert delivered[rid] == [*expected, (None, True)], rid
