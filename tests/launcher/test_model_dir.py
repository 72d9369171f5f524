"""read_model on real model directories written here: config.json plus safetensors files whose
headers are packed by hand (struct + json, zero-filled data), so every number is known."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from omni_dp.launcher.engines.model_dir import read_model

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I32": 4, "U8": 1}

LLAMA_LIKE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "hidden_size": 512,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}


def write_safetensors(file: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A safetensors file of zero-filled tensors; returns its data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    write_raw_safetensors(file, header, offset)
    return offset


def write_raw_safetensors(file: Path, header: dict, data_bytes: int,
                          header_size: int | None = None) -> None:
    """A safetensors file with exactly this header (and optionally a lying length prefix)."""
    encoded = json.dumps(header).encode()
    length = len(encoded) if header_size is None else header_size
    file.write_bytes(struct.pack("<Q", length) + encoded + bytes(data_bytes))


def model_dir(tmp_path: Path, config: dict | None = None, **overrides: object) -> Path:
    """A model directory: config.json (LLAMA_LIKE with overrides; a None override drops the
    key) and one model.safetensors."""
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    merged = {**(LLAMA_LIKE if config is None else config), **overrides}
    (directory / "config.json").write_text(
        json.dumps({k: v for k, v in merged.items() if v is not None}))
    write_safetensors(directory / "model.safetensors",
                      {"embed": ("BF16", [100, 512]), "norm": ("F32", [512])})
    return directory


def only_problem(path: Path | str) -> str:
    facts, problems = read_model(str(path))
    assert facts is None
    assert len(problems) == 1, problems
    return problems[0]


def test_single_file_gives_exact_geometry_and_weight_bytes(tmp_path):
    facts, problems = read_model(str(model_dir(tmp_path)))
    assert problems == []
    assert facts is not None
    assert facts.path == (tmp_path / "model").absolute()
    assert facts.architecture == "LlamaForCausalLM"
    assert facts.weights_bytes == 100 * 512 * 2 + 512 * 4
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim) == (4, 8, 64)
    assert facts.max_positions == 2048
    assert facts.kv_bytes_per_token == 2 * 4 * 8 * 64 * 2


def test_sharded_index_reads_each_shard_once(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA_LIKE))
    first = write_safetensors(directory / "model-00001-of-00002.safetensors",
                              {"a": ("BF16", [64, 64]), "b": ("BF16", [64])})
    second = write_safetensors(directory / "model-00002-of-00002.safetensors",
                               {"c": ("F32", [10, 10])})
    # Not in the index: a stray consolidated copy must not be counted.
    write_safetensors(directory / "consolidated.safetensors", {"x": ("F32", [1000])})
    (directory / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": first + second},
        "weight_map": {"a": "model-00001-of-00002.safetensors",
                       "b": "model-00001-of-00002.safetensors",
                       "c": "model-00002-of-00002.safetensors"},
    }))
    facts, problems = read_model(str(directory))
    assert problems == []
    assert facts is not None
    assert facts.weights_bytes == first + second == 64 * 64 * 2 + 64 * 2 + 100 * 4


def test_several_unindexed_files_are_summed(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "model.safetensors").rename(directory / "part1.safetensors")
    write_safetensors(directory / "part2.safetensors", {"w": ("U8", [1000])})
    facts, problems = read_model(str(directory))
    assert problems == []
    assert facts is not None
    assert facts.weights_bytes == 100 * 512 * 2 + 512 * 4 + 1000


def test_index_naming_a_missing_shard_says_the_download_is_incomplete(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    problem = only_problem(directory)
    assert "model-00001-of-00002.safetensors" in problem and "incomplete" in problem


def test_nested_text_config_supplies_the_geometry(tmp_path):
    text = {k: v for k, v in LLAMA_LIKE.items() if k != "architectures"}
    config = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
              "torch_dtype": "float16", "text_config": {**text, "num_hidden_layers": 6},
              "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024}}
    facts, problems = read_model(str(model_dir(tmp_path, config)))
    assert problems == []
    assert facts is not None
    assert facts.architecture == "LlavaForConditionalGeneration"
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim) == (6, 8, 64)
    assert (facts.dtype, facts.dtype_bytes) == ("float16", 2)  # the top level's dtype wins
    assert facts.max_positions == 2048


def test_gqa_head_count_and_mha_default(tmp_path):
    facts, _ = read_model(str(model_dir(tmp_path / "gqa", num_key_value_heads=2)))
    assert facts is not None and facts.num_kv_heads == 2
    assert facts.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    facts, _ = read_model(str(model_dir(tmp_path / "mha", num_key_value_heads=None)))
    assert facts is not None and facts.num_kv_heads == 8  # absent: num_attention_heads


def test_explicit_head_dim_wins_over_hidden_size(tmp_path):
    facts, _ = read_model(str(model_dir(tmp_path / "explicit", head_dim=128)))
    assert facts is not None and facts.head_dim == 128
    directory = model_dir(tmp_path / "null")
    (directory / "config.json").write_text(json.dumps({**LLAMA_LIKE, "head_dim": None}))
    facts, _ = read_model(str(directory))  # `"head_dim": null` means "not set"
    assert facts is not None and facts.head_dim == 512 // 8


@pytest.mark.parametrize(("key", "value", "dtype", "size"), [
    ("torch_dtype", "bfloat16", "bfloat16", 2),
    ("dtype", "bfloat16", "bfloat16", 2),  # transformers 5 writes `dtype`
    ("torch_dtype", "float32", "float32", 4),
    ("torch_dtype", "float8_e4m3fn", "float8_e4m3fn", 1),
])
def test_dtype_bytes(tmp_path, key, value, dtype, size):
    overrides: dict[str, object] = {"torch_dtype": None, key: value}
    facts, problems = read_model(str(model_dir(tmp_path, **overrides)))
    assert problems == []
    assert facts is not None and (facts.dtype, facts.dtype_bytes) == (dtype, size)


def test_no_config_dtype_takes_the_weights_dominant_float_dtype(tmp_path):
    facts, problems = read_model(str(model_dir(tmp_path, torch_dtype=None)))
    assert problems == []
    assert facts is not None and (facts.dtype, facts.dtype_bytes) == ("bfloat16", 2)


def test_unknown_dtype_is_named(tmp_path):
    problem = only_problem(model_dir(tmp_path, torch_dtype="int4"))
    assert "torch_dtype" in problem and '"int4"' in problem


def test_missing_config(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "config.json").unlink()
    problem = only_problem(directory)
    assert "config.json does not exist" in problem


def test_config_that_is_not_a_json_object(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "config.json").write_text("[1, 2]")
    assert "not an object" in only_problem(directory)


def test_missing_field_is_named(tmp_path):
    problem = only_problem(model_dir(tmp_path, num_hidden_layers=None))
    assert "config.json" in problem and "has no num_hidden_layers" in problem
    assert "text_config" in problem  # where it looked


@pytest.mark.parametrize("value", ["32", 32.0, True, 0, -4])
def test_wrong_type_or_non_positive_field(tmp_path, value):
    problem = only_problem(model_dir(tmp_path, num_key_value_heads=value))
    assert f"num_key_value_heads is {json.dumps(value)}" in problem
    assert "positive integer" in problem


def test_header_length_larger_than_the_file(tmp_path):
    directory = model_dir(tmp_path)
    write_raw_safetensors(directory / "model.safetensors", {}, 0, header_size=10_000)
    problem = only_problem(directory)
    assert "model.safetensors" in problem and "corrupt" in problem
    assert "header length 10000" in problem and "truncated" in problem


def test_file_shorter_than_the_length_prefix(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "model.safetensors").write_bytes(b"\x01\x02")
    assert "shorter than the 8-byte header length" in only_problem(directory)


def test_data_offsets_that_disagree_with_the_shape(tmp_path):
    directory = model_dir(tmp_path)
    header = {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 10]}}
    write_raw_safetensors(directory / "model.safetensors", header, 10)
    problem = only_problem(directory)
    assert "corrupt" in problem and "'w'" in problem
    assert "span 10 bytes" in problem and "needs 12" in problem


def test_data_offsets_past_the_end_of_the_file(tmp_path):
    directory = model_dir(tmp_path)
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    write_raw_safetensors(directory / "model.safetensors", header, 8)
    assert "truncated" in only_problem(directory)


def test_not_a_directory(tmp_path):
    file = tmp_path / "weights.safetensors"
    file.write_bytes(b"")
    problem = only_problem(file)
    assert "is not a directory" in problem and "give a local directory" in problem


def test_hub_like_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    problem = only_problem("meta-llama/Llama-3.1-8B")
    assert "model hub name" in problem
    assert "omni-dp reads the model directory to size replicas" in problem
    assert "no model hub is used" in problem


def test_bin_weights_only(tmp_path):
    directory = model_dir(tmp_path)
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\0" * 16)
    problem = only_problem(directory)
    assert ".bin / .pt weights are not read" in problem
    assert "convert the model to safetensors" in problem


def test_config_and_weight_problems_are_reported_together(tmp_path):
    directory = model_dir(tmp_path, num_hidden_layers=None)
    (directory / "model.safetensors").unlink()
    facts, problems = read_model(str(directory))
    assert facts is None
    assert len(problems) == 2
    assert "num_hidden_layers" in problems[0] and "safetensors" in problems[1]


def test_symlinked_weights_are_followed_and_a_loop_is_a_problem(tmp_path):
    directory = model_dir(tmp_path)
    blob = tmp_path / "blob"
    (directory / "model.safetensors").rename(blob)
    (directory / "model.safetensors").symlink_to(blob)  # as in a Hugging Face cache
    facts, problems = read_model(str(directory))
    assert problems == [] and facts is not None
    assert facts.weights_bytes == 100 * 512 * 2 + 512 * 4

    (directory / "model.safetensors").unlink()
    (directory / "a.safetensors").symlink_to(directory / "b.safetensors")
    (directory / "b.safetensors").symlink_to(directory / "a.safetensors")
    facts, problems = read_model(str(directory))
    assert facts is None
    assert len(problems) == 2 and all("cannot open" in p for p in problems)
