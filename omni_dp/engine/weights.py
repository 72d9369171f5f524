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
