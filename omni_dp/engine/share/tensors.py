"""A model's tensors as the share sees them: named, rebound, viewed, checked.

Names are the state dict's, prefixed by their network ("talker.lm_head.weight"), the spelling of
model.safetensors and of the manifest. Rebinding puts a tensor in the module's own parameter (or
buffer) slot, so that the module computes with it exactly as with the one it was built with.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from omni_dp.engine.share import ShareError
from omni_dp.engine.weights import PipelineModels
from omni_dp.sharefile import DTYPES, TensorEntry

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}  # the manifest's, as torch's


def networks(models: PipelineModels) -> dict[str, nn.Module]:
    return {"talker": models.talker, "vocoder": models.vocoder}


def named_tensors(models: PipelineModels) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, by its prefixed name, in the modules' order."""
    named = {}
    for prefix, module in networks(models).items():
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers()):
            named[f"{prefix}.{name}"] = tensor
    return named


def bind(models: PipelineModels, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Make `tensor` the model's parameter (or buffer) `name`, the old one dropped; returns
    what the module now holds (a Parameter sharing `tensor`'s memory)."""
    network, _, path = name.partition(".")
    owner_path, _, leaf = path.rpartition(".")
    owner = networks(models)[network].get_submodule(owner_path)
    if leaf in owner._parameters:
        # requires_grad=False: nothing here trains, and an integer tensor could not take grad.
        bound = owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        return bound
    if leaf in owner._buffers:
        owner._buffers[leaf] = tensor
        return tensor
    raise KeyError(f"{name} is neither a parameter nor a buffer of the model")


def view_of(flat: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The entry's tensor: bytes [offset, offset + nbytes) of a flat uint8 buffer, no copy."""
    return flat[entry.offset: entry.offset + entry.nbytes].view(TORCH_DTYPES[entry.dtype]).view(
        entry.shape)


def check_materialized(models: PipelineModels) -> None:
    """No meta tensor left anywhere a forward could reach: parameters, buffers, and tensors
    held as plain attributes (the rotary tables). ShareError naming them otherwise."""
    left = []
    for prefix, network in networks(models).items():
        for module_name, module in network.named_modules():
            where = f"{prefix}.{module_name}" if module_name else prefix
            held = itertools.chain(module._parameters.items(), module._buffers.items(),
                                   ((k, v) for k, v in vars(module).items()
                                    if isinstance(v, torch.Tensor)))
            left += [f"{where}.{name}" for name, t in held if t is not None and t.is_meta]
    if left:
        raise ShareError(f"tensors left unbound after attaching: {', '.join(left[:8])}"
                         + (f" and {len(left) - 8} more" if len(left) > 8 else ""))
