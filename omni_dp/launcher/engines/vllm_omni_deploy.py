"""vllm-omni's deploy config (`--deploy-config FILE`), read for what a replica's stages hold on
the GPU: each stage's `gpu_memory_utilization` (a fraction of the whole GPU, per stage
process), its devices and its tensor parallelism. Nothing is loaded or imported from vllm-omni.

The format, as vllm-omni 0.30.0 reads it (vllm_omni/config/stage_config.py: `load_deploy_config`,
`resolve_deploy_yaml`, `_parse_stage_deploy`): a YAML mapping with `stages:`, a list of
mappings keyed by `stage_id`; a stage's engine fields are written flat on the stage or under
its `engine_args:` (which wins); `runtime: {devices: …}` wins over a flat `devices:`; a file may
name a `base_config:` (relative to it) whose stages it overlays field by field, by stage_id.
`--stage-overrides '{"0": {...}}'` on the command line overrides a stage's fields last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from omni_dp.launcher.engines.base import flag_value

MAX_BASE_DEPTH = 8  # base_config chains: deeper is a loop, or nothing a person wrote


@dataclass(frozen=True)
class StageMemory:
    """One stage of a replica as the deploy config and the overrides leave it."""

    stage_id: int
    fraction: float | None  # gpu_memory_utilization; None: unset (vLLM's default)
    devices: str | None
    tensor_parallel_size: int
    max_model_len: int | None = None  # vLLM refuses a KV pool that cannot hold one request


def read_deploy_stages(path: str, overrides: dict[str, dict] | None = None
                       ) -> tuple[tuple[StageMemory, ...], list[str]]:
    """The stages of a deploy file with the command line's per-stage overrides applied, or
    every reason it cannot be read."""
    try:
        raw = _resolve(Path(path), 0)
    except (OSError, yaml.YAMLError, ValueError) as exc:
        return (), [f"--deploy-config {path}: {exc}"]
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        return (), [f"--deploy-config {path}: no `stages:` list (vllm-omni's deploy format: "
                    "stages with stage_id and gpu_memory_utilization each)"]
    stages, problems = [], []
    for entry in stages_raw:
        stage, problem = _stage(entry, overrides or {}, path)
        if problem:
            problems.append(problem)
        elif stage is not None:
            stages.append(stage)
    ids = [s.stage_id for s in stages]
    if len(set(ids)) != len(ids):
        problems.append(f"--deploy-config {path}: a stage_id appears twice: {ids}")
    return tuple(sorted(stages, key=lambda s: s.stage_id)), problems


def stage_overrides(engine_args: tuple[str, ...]) -> tuple[dict[str, dict], list[str]]:
    """The user's `--stage-overrides JSON` (the last one given, as argparse keeps it)."""
    given = flag_value(engine_args, "--stage-overrides")
    if given is None:
        return {}, []
    try:
        parsed = json.loads(given)
    except ValueError as exc:
        return {}, [f"--stage-overrides after --: not JSON ({exc})"]
    if not isinstance(parsed, dict) or not all(
            isinstance(k, str) and k.isdigit() and isinstance(v, dict) for k, v in parsed.items()):
        return {}, ["--stage-overrides after --: vllm-omni takes a JSON object of stage ids "
                    "(\"0\", \"1\", …) to objects of fields"]
    return parsed, []


def _resolve(path: Path, depth: int) -> dict:
    if depth > MAX_BASE_DEPTH:
        raise ValueError(f"base_config nests deeper than {MAX_BASE_DEPTH} files (a loop?)")
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError("not a YAML mapping")
    base_name = data.pop("base_config", None)
    if base_name is None:
        return data
    base = _resolve(path.parent / str(base_name), depth + 1)
    merged = {**base, **{k: v for k, v in data.items() if k != "stages"}}
    by_id = {s["stage_id"]: s for s in base.get("stages") or [] if isinstance(s, dict)}
    for stage in data.get("stages") or []:
        if isinstance(stage, dict) and stage.get("stage_id") in by_id:
            under = by_id[stage["stage_id"]]
            both = {**under, **stage}
            if isinstance(under.get("engine_args"), dict) and isinstance(
                    stage.get("engine_args"), dict):
                both["engine_args"] = {**under["engine_args"], **stage["engine_args"]}
            by_id[stage["stage_id"]] = both
        elif isinstance(stage, dict):
            by_id[stage.get("stage_id")] = stage
    merged["stages"] = list(by_id.values())
    return merged


def _stage(entry: object, overrides: dict[str, dict], path: str
           ) -> tuple[StageMemory | None, str | None]:
    if not isinstance(entry, dict) or not isinstance(entry.get("stage_id"), int):
        return None, f"--deploy-config {path}: a stage without an integer stage_id: {entry!r:.80}"
    stage_id = entry["stage_id"]
    fields = {k: v for k, v in entry.items() if k not in ("engine_args", "runtime")}
    if isinstance(entry.get("engine_args"), dict):
        fields.update(entry["engine_args"])
    runtime = entry.get("runtime") if isinstance(entry.get("runtime"), dict) else {}
    if "devices" in runtime:
        fields["devices"] = runtime["devices"]
    fields.update(overrides.get(str(stage_id), {}))
    fraction = fields.get("gpu_memory_utilization")
    if fraction is not None and (isinstance(fraction, bool)
                                 or not isinstance(fraction, int | float)
                                 or not 0 < fraction <= 1):
        return None, (f"--deploy-config {path}: stage {stage_id}'s gpu_memory_utilization "
                      f"{fraction!r} is not a fraction in (0, 1]")
    tp = fields.get("tensor_parallel_size") or 1
    devices = fields.get("devices")
    length = fields.get("max_model_len")
    return StageMemory(stage_id, None if fraction is None else float(fraction),
                       None if devices is None else str(devices),
                       tp if isinstance(tp, int) else 1,
                       length if isinstance(length, int) and length > 0 else None), None
