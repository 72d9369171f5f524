import dataclasses
import json

import pytest
import torch

from omni_dp.engine.config import (
    ARCHITECTURE,
    CONFIG_FILE,
    PRESETS,
    WEIGHTS_FILE,
    ModelConfig,
    ModelConfigError,
    resolve_model,
)
from omni_dp.engine.plan import ServeOptions, plan_serve, plan_summary
from omni_dp.engine.server import build_models
from omni_dp.engine.weights import load_models, save_models, seeded_models

from support.talker import PIPELINE


def state(models):
    tensors = {f"talker.{k}": v for k, v in models.talker.state_dict().items()}
    tensors |= {f"vocoder.{k}": v for k, v in models.vocoder.state_dict().items()}
    return tensors


def test_seeded_models_are_reproducible_and_seed_dependent():
    a, b, c = seeded_models(PIPELINE, 1), seeded_models(PIPELINE, 1), seeded_models(PIPELINE, 2)
    assert all(torch.equal(a_t, b_t) for a_t, b_t in zip(state(a).values(), state(b).values(),
                                                          strict=True))
    assert not torch.equal(state(a)["talker.embed.weight"], state(c)["talker.embed.weight"])


def test_seeded_models_do_not_touch_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    seeded_models(PIPELINE, 0)
    assert torch.equal(torch.rand(3), expected)


def test_save_then_load_round_trips_identical_tensors(tmp_path):
    models = seeded_models(PIPELINE, 3)
    save_models(models, tmp_path / "model")
    assert (tmp_path / "model" / CONFIG_FILE).is_file()
    assert (tmp_path / "model" / WEIGHTS_FILE).is_file()
    assert not list((tmp_path / "model").glob("*.tmp"))
    cfg, path = resolve_model(str(tmp_path / "model"))
    assert cfg == PIPELINE
    loaded = load_models(cfg, path)
    original, restored = state(models), state(loaded)
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name
        assert tensor.dtype == restored[name].dtype
    assert loaded.source == str(path)


def test_loaded_models_compute_like_the_saved_ones(tmp_path):
    models = seeded_models(PIPELINE, 4)
    save_models(models, tmp_path)
    loaded = load_models(PIPELINE, tmp_path)
    codes = torch.tensor([1, 5, 0, 15, 7])
    assert torch.equal(models.vocoder(codes), loaded.vocoder(codes))


def test_weights_not_matching_config_raise(tmp_path):
    save_models(seeded_models(PIPELINE, 0), tmp_path)
    wider = dataclasses.replace(PIPELINE, intermediate_size=64)
    with pytest.raises(ModelConfigError, match="does not match"):
        load_models(wider, tmp_path)


def test_weights_with_fewer_layers_than_config_raise(tmp_path):
    save_models(seeded_models(PIPELINE, 0), tmp_path)
    deeper = dataclasses.replace(PIPELINE, num_layers=3)
    with pytest.raises(ModelConfigError):
        load_models(deeper, tmp_path)


def test_unreadable_weights_file_raises(tmp_path):
    (tmp_path / WEIGHTS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_models(PIPELINE, tmp_path)


# --- resolve_model -----------------------------------------------------------------------


def test_preset_names_resolve_without_a_directory():
    assert resolve_model("tiny") == (PRESETS["tiny"], None)


def test_neither_preset_nor_directory_raises(tmp_path):
    with pytest.raises(ModelConfigError) as info:
        resolve_model(str(tmp_path / "missing"))
    assert "tiny" in str(info.value)


@pytest.mark.parametrize("present", [[], [CONFIG_FILE], [WEIGHTS_FILE]])
def test_directory_lacking_files_names_save_weights(tmp_path, present):
    for name in present:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelConfigError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert "omni-dp save-weights" in message
    assert CONFIG_FILE in message and WEIGHTS_FILE in message


def test_unreadable_config_json_raises(tmp_path):
    (tmp_path / CONFIG_FILE).write_text("{not json")
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    with pytest.raises(ModelConfigError, match="cannot read"):
        resolve_model(str(tmp_path))


def test_config_json_that_is_not_an_object_raises(tmp_path):
    (tmp_path / CONFIG_FILE).write_text("[1, 2]")
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    with pytest.raises(ModelConfigError, match="object"):
        resolve_model(str(tmp_path))


# --- ModelConfig JSON --------------------------------------------------------------------


def test_config_json_round_trips():
    data = json.loads(json.dumps(PIPELINE.to_json()))
    assert data["architecture"] == ARCHITECTURE
    assert ModelConfig.from_json(data) == PIPELINE
    assert ModelConfig.from_json(json.loads(json.dumps(PRESETS["tiny"].to_json()))) == PRESETS[
        "tiny"]


def test_from_json_rejects_unknown_fields():
    data = PIPELINE.to_json() | {"dropout": 0.1, "alpha": 1}
    with pytest.raises(ModelConfigError) as info:
        ModelConfig.from_json(data)
    assert "alpha" in str(info.value) and "dropout" in str(info.value)


def test_from_json_rejects_unknown_vocoder_fields():
    data = PIPELINE.to_json()
    data["vocoder"] = dict(data["vocoder"], stride=2)
    with pytest.raises(ModelConfigError):
        ModelConfig.from_json(data)


@pytest.mark.parametrize("architecture", [None, "llama", ARCHITECTURE.upper()])
def test_from_json_rejects_wrong_architecture(architecture):
    data = PIPELINE.to_json()
    if architecture is None:
        del data["architecture"]
    else:
        data["architecture"] = architecture
    with pytest.raises(ModelConfigError, match="architecture"):
        ModelConfig.from_json(data)


def test_from_json_rejects_missing_required_field():
    data = PIPELINE.to_json()
    del data["hidden_size"]
    with pytest.raises(ModelConfigError):
        ModelConfig.from_json(data)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"num_heads": 3}, "multiple of num_kv_heads"),
        ({"head_dim": 7}, "even"),
        ({"num_layers": 0}, "num_layers"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_from_json_validates_values(change, words):
    with pytest.raises(ModelConfigError, match=words):
        ModelConfig.from_json(PIPELINE.to_json() | change)


def test_from_json_does_not_modify_its_input():
    data = PIPELINE.to_json()
    snapshot = json.loads(json.dumps(data))
    ModelConfig.from_json(data)
    assert json.loads(json.dumps(data)) == snapshot


@pytest.mark.parametrize("vocoder", [None, [], "conv"])
def test_from_json_rejects_vocoder_that_is_not_an_object(vocoder):
    data = PIPELINE.to_json() | {"vocoder": vocoder}
    with pytest.raises(ModelConfigError):
        ModelConfig.from_json(data)


def test_from_json_rejects_string_for_integer_field():
    with pytest.raises(ModelConfigError):
        ModelConfig.from_json(PIPELINE.to_json() | {"hidden_size": "32"})


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_dry_run_weights_bytes_are_what_the_server_holds(dtype):
    plan = plan_serve(ServeOptions(device="cpu", dtype=dtype, threads=1, max_total_tokens=256))
    models = build_models(plan)
    held = sum(p.numel() * p.element_size()
               for module in (models.talker, models.vocoder) for p in module.parameters())
    assert plan_summary(plan)["weights_bytes"] == held


def test_dry_run_overhead_covers_a_cuda_context_on_a_gpu():
    """A replica on a GPU holds a CUDA context and library workspaces (≥ 0.5 GiB on Hopper)
    besides weights and KV; the launcher's memory fit must count them."""
    from omni_dp.engine.plan import overhead_bytes

    plan = plan_serve(ServeOptions(device="cpu", threads=1, max_total_tokens=256))
    assert plan_summary(plan)["overhead_bytes"] == overhead_bytes(torch.device("cpu"))
    assert overhead_bytes(torch.device("cuda", 0)) >= 1024**3 > overhead_bytes(
        torch.device("cpu"))
