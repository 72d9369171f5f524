"""Model architecture: the presets, and `config.json` for a model directory.

One `ModelConfig` describes both networks of the built-in pipeline (talker and vocoder) and the
token layout they share. The token layout is fixed by the config, so weights saved by one run are
read back with exactly the vocabulary they were made for.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "omni-dp-tts"


class ModelConfigError(ValueError):
    """A model preset or directory that cannot be used, with the reason."""


@dataclass(frozen=True)
class VocoderConfig:
    """A causal convolutional upsampler from codec tokens to waveform samples."""

    embed_dim: int = 128
    channels: tuple[int, ...] = (64, 32, 16)
    # 8 × 12 × 10 = 960 samples per token: a 25 Hz codec at 24 kHz, like current TTS codecs
    # (12.5–25 Hz), which keep the autoregressive steps per second of audio few.
    upsample_factors: tuple[int, ...] = (8, 12, 10)
    kernel_size: int = 7
    # Streaming: the first chunk is short for a low time-to-first-audio, later ones longer.
    first_chunk_tokens: int = 3
    chunk_tokens: int = 12

    @property
    def samples_per_token(self) -> int:
        n = 1
        for factor in self.upsample_factors:
            n *= factor
        return n


@dataclass(frozen=True)
class ModelConfig:
    """Talker transformer + vocoder + the token layout they share."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # Token layout: [text bytes | specials | speakers | codec codes]; the talker predicts codes+END.
    text_vocab_size: int = 256
    num_speakers: int = 8
    codebook_size: int = 256
    sample_rate: int = 24000
    temperature: float = 0.8
    max_new_tokens: int = 1024
    # Default generation length when a request gives none: a duration prior per input byte
    # (2 tokens = 80 ms of audio per character, ~12.5 characters per second of speech).
    new_tokens_per_input_byte: float = 2.0
    min_new_tokens_default: int = 8
    vocoder: VocoderConfig = field(default_factory=VocoderConfig)

    # --- token layout -------------------------------------------------------------------
    @property
    def bos_text_id(self) -> int:
        return self.text_vocab_size

    @property
    def eos_text_id(self) -> int:
        return self.text_vocab_size + 1

    @property
    def bos_audio_id(self) -> int:
        return self.text_vocab_size + 2

    @property
    def first_speaker_id(self) -> int:
        return self.text_vocab_size + 3

    @property
    def first_code_id(self) -> int:
        return self.first_speaker_id + self.num_speakers

    @property
    def vocab_size(self) -> int:
        return self.first_code_id + self.codebook_size

    @property
    def end_of_audio(self) -> int:
        """Index of the end token among the talker's outputs (codes are 0..codebook_size-1)."""
        return self.codebook_size

    @property
    def frame_rate_hz(self) -> float:
        return self.sample_rate / self.vocoder.samples_per_token

    def validate(self) -> None:
        problems = []
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position", "codebook_size", "num_speakers",
                     "sample_rate", "max_new_tokens"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append("num_heads must be a multiple of num_kv_heads (grouped queries)")
        if self.head_dim % 2:
            problems.append("head_dim must be even (rotary positions rotate pairs)")
        if self.temperature <= 0:
            problems.append("temperature must be positive")
        if problems:
            raise ModelConfigError(f"model config {self.name!r}: " + "; ".join(problems))

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["architecture"] = ARCHITECTURE
        return data

    @classmethod
    def from_json(cls, data: dict) -> ModelConfig:
        data = dict(data)
        arch = data.pop("architecture", None)
        if arch != ARCHITECTURE:
            raise ModelConfigError(f"architecture is {arch!r}, expected {ARCHITECTURE!r}")
        vocoder = data.pop("vocoder", {})
        if not isinstance(vocoder, dict):
            raise ModelConfigError("vocoder must be a JSON object")
        problems = _type_problems(cls, data, "")
        problems += _type_problems(VocoderConfig, vocoder, "vocoder.")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in data and f.name != "vocoder"
                   and f.default is dataclasses.MISSING]
        problems += [f"{name} is missing" for name in missing]
        if problems:
            raise ModelConfigError("; ".join(problems))
        voc_fields = {k: tuple(v) if isinstance(v, list) else v for k, v in vocoder.items()}
        cfg = cls(**data, vocoder=VocoderConfig(**voc_fields))
        cfg.validate()
        return cfg


def _type_problems(cls: type, data: dict, prefix: str) -> list[str]:
    """Unknown fields and values of the wrong JSON type, each named."""
    hints = typing.get_type_hints(cls)
    problems = []
    for name, value in data.items():
        expected = hints.get(name)
        if expected is None:
            problems.append(f"unknown field {prefix}{name}")
            continue
        if expected is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif expected is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif expected is str:
            ok = isinstance(value, str)
        else:  # tuple[int, ...]
            ok = isinstance(value, (list, tuple)) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )
        if not ok:
            problems.append(f"{prefix}{name} must be {getattr(expected, '__name__', expected)}")
    return problems


PRESETS: dict[str, ModelConfig] = {
    # ~3.4M parameters: fast on one CPU core; what the tests and CPU benchmarks use.
    "tiny": ModelConfig(
        name="tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=768,
    ),
    # ~80M parameters: for GPU demos.
    "small": ModelConfig(
        name="small", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
        intermediate_size=2048,
        vocoder=VocoderConfig(embed_dim=256, channels=(128, 64, 32)),
    ),
}


def resolve_model(spec: str) -> tuple[ModelConfig, Path | None]:
    """`tiny`/`small` → (preset, None); a directory → (its config, the directory)."""
    if spec in PRESETS:
        return PRESETS[spec], None
    path = Path(spec)
    if not path.is_dir():
        raise ModelConfigError(
            f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}), the voice joe, "
            "nor a directory"
        )
    config_path = path / CONFIG_FILE
    if not (config_path.is_file() and (path / WEIGHTS_FILE).is_file()):
        raise ModelConfigError(
            f"model directory {path} must hold {CONFIG_FILE} and {WEIGHTS_FILE}; "
            "write one with `omni-dp save-weights DIR`"
        )
    try:
        data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{config_path} must hold a JSON object")
    return ModelConfig.from_json(data), path
