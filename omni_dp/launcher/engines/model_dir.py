"""A local Hugging Face-style model directory, read without loading it: config.json for the KV
geometry, the safetensors headers for the weights' bytes.

The launcher's memory-fit preflight and its KV-pin translation for external engines need these
numbers before any replica starts, in well under a second, without torch and without a model hub.
Bad input never raises: read_model returns every problem found, each naming the file, what is
wrong with it and what to do.

The safetensors headers are read by hand (8 bytes of length, then JSON) rather than through the
`safetensors` library: its public API does not expose data_offsets (so a header whose offsets
disagree with its shapes cannot be named per tensor), its `framework="pt"` imports torch (the
launcher must not), and the dtypes it accepts depend on the installed version.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from omni_dp.launcher.engines.base import ModelFacts

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Bounds on what is read, so a wrong file (a dataset, a tarball renamed) costs no memory.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_INDEX_BYTES = 64 * 1024 * 1024  # the largest models' indexes are a few MiB
MAX_HEADER_BYTES = 100 * 1024 * 1024  # about the safetensors library's own limit (100 MB)

# Multimodal models nest the language model's config under one of these keys.
NESTED_CONFIG_KEYS = ("text_config", "llm_config", "language_config")

# config.json's dtype names → bytes per element (what one KV-cache element costs at that dtype).
CONFIG_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}
CANONICAL_DTYPE = {"float": "float32", "half": "float16"}

# safetensors dtypes → bits per element (sub-byte types pack: a tensor's bits divide by 8).
SAFETENSORS_DTYPE_BITS = {
    "F64": 64, "I64": 64, "U64": 64,
    "F32": 32, "I32": 32, "U32": 32,
    "F16": 16, "BF16": 16, "I16": 16, "U16": 16,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I8": 8, "U8": 8, "BOOL": 8,
    "F6_E2M3": 6, "F6_E3M2": 6,
    "F4": 4,
}
# The floating safetensors dtypes that name a config dtype: the weights' dtype when config.json
# gives none (vLLM falls back to the checkpoint's own dtype the same way).
SAFETENSORS_TO_CONFIG_DTYPE = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

# `org/model`: what a model hub name looks like (the engines would download it; omni-dp does not).
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
NOT_LOCAL = ("omni-dp reads the model directory to size replicas; give a local directory "
             "(no model hub is used)")


class _Unreadable(Exception):
    """One file's problem, already worded for the user; read_model turns it into a problem."""


@dataclass(frozen=True)
class _Geometry:
    """What config.json says about the model, before the weights are read."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str | None  # None: config.json names none (the weights' dtype is used)
    max_positions: int | None


def read_model(path: str) -> tuple[ModelFacts | None, list[str]]:
    """The model directory's facts, or None and every problem found (config and weights both,
    so one run shows all that needs fixing)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        return None, [_not_a_directory(path, directory)]
    geometry, problems = _read_config(directory / CONFIG_FILE)
    weights_by_dtype, weight_problems = _read_weights(directory)
    problems += weight_problems
    if geometry is None or weights_by_dtype is None or problems:
        return None, problems

    dtype = geometry.dtype or _dominant_float_dtype(weights_by_dtype)
    if dtype is None:
        return None, [f"{directory / CONFIG_FILE} names no dtype (torch_dtype / dtype) and the "
                      f"safetensors weights hold no floating tensors to take it from; set "
                      f"\"torch_dtype\" in config.json"]
    return ModelFacts(
        path=directory.absolute(),
        architecture=geometry.architecture,
        weights_bytes=sum(weights_by_dtype.values()),
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=dtype,
        dtype_bytes=CONFIG_DTYPE_BYTES[dtype],
        max_positions=geometry.max_positions,
    ), []


def _not_a_directory(given: str, directory: Path) -> str:
    if directory.exists():
        return f"model {given} is not a directory; {NOT_LOCAL}"
    if HUB_NAME.match(given):
        return f"model {given} looks like a model hub name, not a local directory; {NOT_LOCAL}"
    return f"model directory {given} does not exist; {NOT_LOCAL}"


def _open_regular(file: Path) -> tuple[BinaryIO, int]:
    """The open file and its size. Symlinks are followed (HF caches are made of them); a loop,
    a missing file or no permission is an OSError, and a FIFO or device is refused before it
    can block a read."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise _Unreadable(f"{file} does not exist") from None
    except OSError as exc:
        raise _Unreadable(f"cannot open {file}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise _Unreadable(f"cannot read {file}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _Unreadable(f"{file} is not a regular file")
    return os.fdopen(fd, "rb"), info.st_size


def _read_json_object(file: Path, limit: int) -> dict:
    """A JSON object from a file of at most `limit` bytes."""
    handle, _ = _open_regular(file)
    try:
        with handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise _Unreadable(f"cannot read {file}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise _Unreadable(f"{file} is larger than {limit // (1024 * 1024)} MiB; "
                          f"is it the model's {file.name}?")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _Unreadable(f"{file} is not valid JSON ({exc}); restore it from the model's "
                          f"source") from None
    if not isinstance(value, dict):
        raise _Unreadable(f"{file} holds a JSON {type(value).__name__}, not an object; "
                          f"restore it from the model's source")
    return value


# -- config.json ------------------------------------------------------------------------------


def _read_config(file: Path) -> tuple[_Geometry | None, list[str]]:
    try:
        config = _read_json_object(file, MAX_CONFIG_BYTES)
    except _Unreadable as exc:
        return None, [f"{exc} (the KV cache is sized from config.json; a Hugging Face model "
                      f"directory has one)"]
    section, where = _geometry_section(config, file)
    problems: list[str] = []

    present = _present(section)
    num_layers = _positive_int(section, "num_hidden_layers", where, problems)
    # The attention head count stands in for whichever of these two the config leaves out.
    attention_heads = _positive_int(
        section, "num_attention_heads", where, problems,
        required="num_key_value_heads" not in present or "head_dim" not in present)
    if "num_key_value_heads" in present:
        num_kv_heads = _positive_int(section, "num_key_value_heads", where, problems)
    else:
        num_kv_heads = attention_heads  # no num_key_value_heads: multi-head attention
    head_dim = _head_dim(section, where, attention_heads, problems)
    max_positions = _positive_int(section, "max_position_embeddings", where, problems,
                                  required=False)
    dtype = _config_dtype(config, section, file, where, problems)
    architecture = _architecture(config, section, file, problems)

    if problems or None in (num_layers, num_kv_heads, head_dim, architecture):
        return None, problems
    return _Geometry(architecture, num_layers, num_kv_heads, head_dim, dtype, max_positions), []


def _geometry_section(config: dict, file: Path) -> tuple[dict, str]:
    """The part of the config that describes the language model, and how to name it."""
    if "num_hidden_layers" in config:
        return config, str(file)
    for key in NESTED_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and "num_hidden_layers" in nested:
            return nested, f"{file} ({key})"
    return config, f"{file} (top level, {', '.join(NESTED_CONFIG_KEYS)})"


def _present(section: dict) -> set[str]:
    """Keys with a value: HF configs write `"head_dim": null` for "not set"."""
    return {key for key, value in section.items() if value is not None}


def _positive_int(section: dict, name: str, where: str, problems: list[str],
                  required: bool = True) -> int | None:
    value = section.get(name)
    if value is None:
        if required:
            problems.append(f"{where} has no {name}; it is needed to size the KV cache "
                            f"(is this a Hugging Face model directory?)")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        problems.append(f"{where}: {name} is {json.dumps(value)}; it must be a positive "
                        f"integer (fix config.json)")
        return None
    return value


def _head_dim(section: dict, where: str, attention_heads: int | None,
              problems: list[str]) -> int | None:
    """The explicit head_dim, else hidden_size // num_attention_heads (as transformers does)."""
    if "head_dim" in _present(section):
        return _positive_int(section, "head_dim", where, problems)
    hidden_size = _positive_int(section, "hidden_size", where, problems)
    if attention_heads is None or hidden_size is None:
        return None
    if hidden_size % attention_heads:
        problems.append(f"{where}: hidden_size {hidden_size} does not divide by "
                        f"num_attention_heads {attention_heads}; add head_dim to config.json")
        return None
    return hidden_size // attention_heads


def _config_dtype(config: dict, section: dict, file: Path, where: str,
                  problems: list[str]) -> str | None:
    """`dtype` (transformers 5) or `torch_dtype`, from the top level first (as vLLM reads it),
    then the language model's section; None when neither says."""
    for place, name in ((config, str(file)), (section, where)):
        for key in ("dtype", "torch_dtype"):
            value = place.get(key)
            if value is None:
                continue
            dtype = value.lower().removeprefix("torch.") if isinstance(value, str) else None
            if dtype not in CONFIG_DTYPE_BYTES:
                problems.append(f"{name}: {key} is {json.dumps(value)}, which omni-dp cannot "
                                f"size; one of {', '.join(sorted(CONFIG_DTYPE_BYTES))} is "
                                f"expected")
                return None
            return CANONICAL_DTYPE.get(dtype, dtype)
    return None


def _architecture(config: dict, section: dict, file: Path, problems: list[str]) -> str | None:
    """architectures[0] (the class the engine loads), else model_type."""
    architectures = config.get("architectures")
    if architectures is not None:
        if (isinstance(architectures, list) and architectures
                and isinstance(architectures[0], str) and architectures[0]):
            return architectures[0]
        problems.append(f"{file}: architectures is {json.dumps(architectures)}; it must be a "
                        f"list of class names (fix config.json)")
        return None
    for place in (config, section):
        model_type = place.get("model_type")
        if isinstance(model_type, str) and model_type:
            return model_type
    problems.append(f"{file} has neither architectures nor model_type; is this a Hugging Face "
                    f"model directory?")
    return None


# -- safetensors weights ----------------------------------------------------------------------


def _read_weights(directory: Path) -> tuple[dict[str, int] | None, list[str]]:
    """Bytes per safetensors dtype over every weight file, read from the headers only."""
    files, problems = _weight_files(directory)
    if problems:
        return None, problems
    by_dtype: dict[str, int] = {}
    for file in files:
        try:
            for dtype, size in _safetensors_bytes(file).items():
                by_dtype[dtype] = by_dtype.get(dtype, 0) + size
        except _Unreadable as exc:
            problems.append(str(exc))
    return (None if problems else by_dtype), problems


def _weight_files(directory: Path) -> tuple[list[Path], list[str]]:
    """The index's shards (each once), else model.safetensors, else every *.safetensors."""
    index = directory / INDEX_FILE
    if index.exists():
        return _indexed_shards(index)
    single = directory / SINGLE_WEIGHTS_FILE
    if single.exists():
        return [single], []
    try:
        files = sorted(directory.glob("*.safetensors"))
    except OSError as exc:
        return [], [f"cannot list {directory}: {exc.strerror or exc}"]
    if not files:
        return [], [f"{directory} has no *.safetensors weights; .bin / .pt weights are not "
                    f"read: omni-dp sizes replicas from safetensors headers; convert the model "
                    f"to safetensors"]
    return files, []


def _indexed_shards(index: Path) -> tuple[list[Path], list[str]]:
    try:
        content = _read_json_object(index, MAX_INDEX_BYTES)
    except _Unreadable as exc:
        return [], [str(exc)]
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        return [], [f"{index} has no weight_map object naming the shards; restore it from "
                    f"the model's source"]
    shards: list[Path] = []
    problems: list[str] = []
    names = set(weight_map.values())
    if not all(isinstance(name, str) and name for name in names):
        return [], [f"{index}: weight_map values must be shard file names; restore it from "
                    f"the model's source"]
    for name in sorted(names):
        relative = Path(name)
        if relative.is_absolute() or ".." in relative.parts:
            problems.append(f"{index} names shard {name!r} outside the model directory; "
                            f"restore the index from the model's source")
            continue
        shard = index.parent / relative
        if not shard.exists():
            problems.append(f"{index} names shard {name}, which is not in {index.parent}: "
                            f"the download is incomplete")
            continue
        shards.append(shard)
    return shards, problems


def _safetensors_bytes(file: Path) -> dict[str, int]:
    """Bytes per dtype of one safetensors file, from its header alone: 8 bytes little-endian
    of header length N, then N bytes of JSON {name: {dtype, shape, data_offsets}}. Raises
    _Unreadable naming the file (and the tensor) when the header is corrupt."""
    corrupt = f"{file} has a corrupt safetensors header"
    handle, file_size = _open_regular(file)
    try:
        with handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _Unreadable(f"{corrupt}: the file is {file_size} bytes, shorter than the "
                                  f"8-byte header length; re-download it")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
                raise _Unreadable(f"{corrupt}: its header length {header_size} is larger "
                                  f"than the file ({file_size} bytes) or the "
                                  f"{MAX_HEADER_BYTES // (1024 * 1024)} MiB limit; the file "
                                  f"is truncated or not safetensors, re-download it")
            raw = handle.read(header_size)
    except OSError as exc:
        raise _Unreadable(f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _Unreadable(f"{corrupt}: it is not JSON; re-download it") from None
    if not isinstance(header, dict):
        raise _Unreadable(f"{corrupt}: it is not a JSON object; re-download it")
    data_size = file_size - 8 - header_size
    by_dtype: dict[str, int] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, size = _tensor_bytes(entry, data_size, f"{corrupt}: tensor {name!r}")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
    if sum(by_dtype.values()) > data_size:
        raise _Unreadable(f"{corrupt}: its tensors' data_offsets overlap (they span more than "
                          f"the file's {data_size} data bytes); re-download it")
    return by_dtype


def _tensor_bytes(entry: object, data_size: int, where: str) -> tuple[str, int]:
    """(dtype, bytes) of one header entry, checked against its shape and the file's data."""
    if not isinstance(entry, dict):
        raise _Unreadable(f"{where} is not an object; re-download the file")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise _Unreadable(f"{where} has dtype {json.dumps(dtype)}, which omni-dp does not know; "
                          f"known: {', '.join(SAFETENSORS_DTYPE_BITS)}")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise _Unreadable(f"{where} has shape {json.dumps(shape)}, not a list of sizes; "
                          f"re-download the file")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))
            and offsets[0] <= offsets[1] <= data_size):
        raise _Unreadable(f"{where} has data_offsets {json.dumps(offsets)}, outside the file's "
                          f"{data_size} data bytes; the file is truncated, re-download it")
    size = offsets[1] - offsets[0]
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if bits != size * 8:
        raise _Unreadable(f"{where}: data_offsets span {size} bytes but shape {shape} of "
                          f"{dtype} needs {-(-bits // 8)}; re-download the file")
    return dtype, size


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dominant_float_dtype(by_dtype: dict[str, int]) -> str | None:
    """The config dtype of the floating safetensors dtype holding the most bytes."""
    floats = {dtype: size for dtype, size in by_dtype.items()
              if dtype in SAFETENSORS_TO_CONFIG_DTYPE}
    if not floats:
        return None
    return SAFETENSORS_TO_CONFIG_DTYPE[max(floats, key=lambda dtype: (floats[dtype], dtype))]
