"""Seeded weights, and saving/loading them as `config.json` + `model.safetensors`.

Weights are always initialised on the CPU in float32 from one seed and only then cast and moved,
so every replica of a preset gets the same numbers whatever its device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from omni_dp.engine.config import CONFIG_FILE, WEIGHTS_FILE, ModelConfig, ModelConfigError
from omni_dp.engine.model import Talker
from omni_dp.engine.vocoder import Vocoder


@dataclass
class PipelineModels:
    cfg: ModelConfig
    talker: Talker
    vocoder: Vocoder
    source: str  # where the weights came from, for /get_server_info

    @property
    def num_parameters(self) -> dict[str, int]:
        return {
            "talker": sum(p.numel() for p in self.talker.parameters()),
            "vocoder": sum(p.numel() for p in self.vocoder.parameters()),
        }


def place(models: PipelineModels, device: torch.device | None, dtype: torch.dtype) -> None:
    """Where and in what dtype a replica holds its models: the talker in the plan's dtype, the
    vocoder in float32 (its audio is quantised to 16 bits anyway). One place, so that a
    weight-sharing follower's meta-device model (device None) has exactly the dtypes its
    leader's real one has."""
    models.talker.to(device=device, dtype=dtype)
    models.vocoder.to(device=device)


class _NoInitOnMeta(TorchFunctionMode):
    """nn.init's initialisers as no-ops on meta tensors, where they have nothing to fill.

    Not for speed: normal_'s meta kernel is written in Python, and its first use imports some
    800 modules (torch._decomp, sympy, mpmath), ~70 MB of heap in every process that builds a
    meta model (a sharing replica's plan, a follower) and never needs them again.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


_INITIALISERS = frozenset({
    torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
    torch.nn.init.trunc_normal_, torch.nn.init.zeros_, torch.nn.init.ones_,
    torch.Tensor.normal_, torch.Tensor.uniform_,
})


def meta_models(cfg: ModelConfig, dtype: torch.dtype, source: str = "meta") -> PipelineModels:
    """The models with the shapes and dtypes a replica holds, on the meta device: no memory.
    For sizes (the dry run) and for a weight-sharing follower to bind its leader's tensors to."""
    with torch.device("meta"), _NoInitOnMeta():
        models = PipelineModels(cfg, Talker(cfg).eval(), Vocoder(cfg).eval(), source)
    place(models, None, dtype)
    return models


def seeded_models(cfg: ModelConfig, seed: int) -> PipelineModels:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        talker = Talker(cfg)
        vocoder = Vocoder(cfg)
    return PipelineModels(cfg, talker.eval(), vocoder.eval(), f"preset {cfg.name}, seed {seed}")


def save_models(models: PipelineModels, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"talker.{k}": v for k, v in models.talker.state_dict().items()}
    tensors |= {f"vocoder.{k}": v for k, v in models.vocoder.state_dict().items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(models.cfg.to_json(), indent=2) + "\n")


def load_models(cfg: ModelConfig, directory: Path) -> PipelineModels:
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except Exception as exc:  # safetensors raises its own error types
        raise ModelConfigError(f"cannot read {directory / WEIGHTS_FILE}: {exc}") from None
    models = PipelineModels(cfg, Talker(cfg).eval(), Vocoder(cfg).eval(), str(directory))
    for prefix, module in (("talker.", models.talker), ("vocoder.", models.vocoder)):
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(state, strict=True)
        except RuntimeError as exc:
            raise ModelConfigError(
                f"{directory / WEIGHTS_FILE} does not match its {CONFIG_FILE}: {exc}"
            ) from None
    return models
