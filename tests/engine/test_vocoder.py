import numpy as np
import pytest
import torch

from omni_dp.engine.config import PRESETS
from omni_dp.engine.vocoder import ChunkSchedule, VocoderStream, decode_all, to_pcm16

CFG = PRESETS["tiny"]
SPT = CFG.vocoder.samples_per_token


def random_codes(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.codebook_size, (n,), generator=generator).tolist()


def schedule():
    return ChunkSchedule(CFG.vocoder.first_chunk_tokens, CFG.vocoder.chunk_tokens)


def stream_chunks(vocoder, codes, batch_sizes):
    """Push `codes` in batches of the given sizes (cycled), then finish; return the chunks."""
    stream = VocoderStream(vocoder, schedule())
    chunks = []
    i = 0
    k = 0
    while i < len(codes):
        n = batch_sizes[k % len(batch_sizes)]
        chunks += stream.push(codes[i : i + n], finished=False)
        i += n
        k += 1
    chunks += stream.push([], finished=True)
    return chunks


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def whole_pcm(vocoder, codes):
    return pcm(to_pcm16(torch.from_numpy(decode_all(vocoder, codes))))


# --- chunk schedule ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("done", "available", "expected"),
    [
        (0, 0, []),
        (0, 4, []),
        (0, 5, [5]),
        (0, 29, [5]),
        (0, 30, [5, 30]),
        (0, 80, [5, 30, 55, 80]),
        (5, 29, []),
        (5, 30, [30]),
        (5, 56, [30, 55]),
        (30, 54, []),
        (30, 55, [55]),
    ],
)
def test_boundaries_between(done, available, expected):
    assert ChunkSchedule(5, 25).boundaries_between(done, available) == expected


def test_boundaries_are_strictly_after_done_and_at_most_available():
    chunks = ChunkSchedule(3, 7)
    for done in (0, 3, 10, 17):
        for available in range(done, 40):
            ends = chunks.boundaries_between(done, available)
            assert all(done < end <= available for end in ends)
            assert ends == sorted(ends)


# --- decoding ----------------------------------------------------------------------------


def test_output_length_is_tokens_times_samples_per_token(vocoder):
    for n in (1, 4, 37):
        assert decode_all(vocoder, random_codes(n)).shape == (n * SPT,)
    assert decode_all(vocoder, []).shape == (0,)


def test_samples_stay_below_full_scale(vocoder):
    samples = decode_all(vocoder, random_codes(40))
    assert np.abs(samples).max() <= 0.5
    assert np.abs(samples).max() > 0.01  # not silence


def test_to_pcm16_scales_clamps_and_is_little_endian():
    data = to_pcm16(torch.tensor([0.0, 0.5, -1.0, 1.0, 2.0, -3.0]))
    assert len(data) == 12
    assert pcm(data).tolist() == [0, 16384, -32767, 32767, 32767, -32767]
    assert data[2:4] == (16384).to_bytes(2, "little", signed=True)


def test_chunked_stream_matches_whole_decode_within_one_lsb(vocoder):
    codes = random_codes(73, seed=1)
    chunks = stream_chunks(vocoder, codes, [3, 1, 11, 2, 7])
    streamed = pcm(b"".join(chunks))
    whole = whole_pcm(vocoder, codes)
    assert streamed.shape == whole.shape == (73 * SPT,)
    assert np.abs(streamed - whole).max() <= 1


def test_chunks_follow_the_schedule_and_end_with_the_tail(vocoder):
    first, every = CFG.vocoder.first_chunk_tokens, CFG.vocoder.chunk_tokens
    n = first + 2 * every + every // 2  # a first chunk, two full chunks, a short tail
    codes = random_codes(n, seed=2)
    chunks = stream_chunks(vocoder, codes, [4, 9])
    full, tail = divmod(n - first, every)
    expected = [first] + [every] * full + ([tail] if tail else [])
    assert tail and full >= 2  # the case covers a first chunk, full chunks and a short tail
    assert [len(c) // 2 // SPT for c in chunks] == expected


def test_same_codes_in_different_batches_give_identical_bytes(vocoder):
    codes = random_codes(64, seed=3)
    reference = stream_chunks(vocoder, codes, [len(codes)])
    for sizes in ([1], [2, 5], [13], [30, 1, 4]):
        assert stream_chunks(vocoder, codes, sizes) == reference


def test_no_audio_before_the_first_chunk_is_complete(vocoder):
    stream = VocoderStream(vocoder, schedule())
    first = CFG.vocoder.first_chunk_tokens
    codes = random_codes(first)
    for code in codes[:-1]:
        assert stream.push([code], finished=False) == []
    chunks = stream.push(codes[-1:], finished=False)
    assert len(chunks) == 1 and len(chunks[0]) == 2 * first * SPT


def test_finish_on_a_chunk_boundary_adds_no_empty_chunk(vocoder):
    n = CFG.vocoder.first_chunk_tokens + CFG.vocoder.chunk_tokens
    stream = VocoderStream(vocoder, schedule())
    assert len(stream.push(random_codes(n), finished=False)) == 2
    assert stream.push([], finished=True) == []


def test_finish_without_codes_gives_nothing(vocoder):
    assert VocoderStream(vocoder, schedule()).push([], finished=True) == []


def test_short_utterance_is_one_tail_chunk_equal_to_whole_decode(vocoder):
    codes = random_codes(CFG.vocoder.first_chunk_tokens - 1, seed=4)
    chunks = VocoderStream(vocoder, schedule()).push(codes, finished=True)
    assert len(chunks) == 1
    assert np.abs(pcm(chunks[0]) - whole_pcm(vocoder, codes)).max() <= 1


def test_left_context_is_needed_for_seamless_joins(vocoder):
    # Without its left context a chunk sounds different from the same span of the whole
    # decode: the seamless-join test above is not passing vacuously.
    codes = random_codes(40, seed=5)
    start, end = 20, 30
    alone = pcm(to_pcm16(vocoder(torch.tensor(codes[start:end]))))
    whole = whole_pcm(vocoder, codes)[start * SPT : end * SPT]
    assert np.abs(alone - whole).max() > 10


def test_decode_range_reads_only_its_left_context_window(vocoder):
    codes = random_codes(40, seed=6)
    start, end = 25, 32
    edge = start - vocoder.left_context_tokens
    base = vocoder.decode_range(codes, start, end)
    assert base.shape == ((end - start) * SPT,)
    before_window = list(codes)
    before_window[edge - 1] = (codes[edge - 1] + 1) % CFG.codebook_size
    assert torch.equal(vocoder.decode_range(before_window, start, end), base)
    in_window = list(codes)
    in_window[start - 1] = (codes[start - 1] + 1) % CFG.codebook_size
    assert not torch.equal(vocoder.decode_range(in_window, start, end), base)
