"""Placement configuration: defaults, then a YAML file, then dotted CLI overrides.

Each layer's values and provenance, the closest-name suggestions, and every problem of every
layer reported at once with the key as the user wrote it.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from omni_dp.placement.builtin import BUILTIN_PIPELINE
from omni_dp.placement.config import (
    PLACEMENT_FIELDS,
    STAGE_FIELDS,
    load_placement,
    split_overrides,
)
from omni_dp.placement.model import (
    PlacementConfig,
    PlacementError,
    PlacementRequest,
    Provenance,
    Source,
    StageConfig,
)
from omni_dp.yamlconfig import brief

ROOT = Path(__file__).resolve().parents[1]


def load(*flags: str, file: Path | None = None) -> PlacementRequest:
    pairs, rest = split_overrides(list(flags))
    assert rest == []
    return load_placement(BUILTIN_PIPELINE, file, pairs)


def problems(*flags: str, file: Path | None = None) -> list[str]:
    with pytest.raises(PlacementError) as caught:
        load(*flags, file=file)
    return caught.value.problems


def yaml_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "placement.yaml"
    path.write_text(text)
    return path


def test_the_placement_package_imports_without_torch():
    code = ("import omni_dp.placement.validate, omni_dp.placement.config, "
            "omni_dp.placement.table, omni_dp.placement.builtin, sys; "
            "assert 'torch' not in sys.modules")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_the_parsers_cover_exactly_the_config_fields():
    assert set(STAGE_FIELDS) == {f.name for f in dataclasses.fields(StageConfig)}
    assert set(PLACEMENT_FIELDS) == {f.name for f in dataclasses.fields(PlacementConfig)}


# --- split_overrides -------------------------------------------------------------------------
def test_split_overrides_takes_both_forms_and_returns_the_rest_in_order():
    pairs, rest = split_overrides(["--model", "small", "--vocoder.process", "vocoder",
                                   "--talker.gpu_memory_fraction=0.85", "-v", "--", "x.y"])
    assert pairs == [("vocoder.process", "vocoder"), ("talker.gpu_memory_fraction", "0.85")]
    assert rest == ["--model", "small", "-v", "--", "x.y"]


def test_a_dotted_flag_without_a_value_is_a_problem():
    with pytest.raises(PlacementError) as caught:
        split_overrides(["--talker.process", "--vocoder.process", "v", "--talker.tp_size"])
    assert caught.value.problems == [
        "--talker.process needs a value: --talker.process VALUE or --talker.process=VALUE",
        "--talker.tp_size needs a value: --talker.tp_size VALUE or --talker.tp_size=VALUE",
    ]


# --- layers and provenance -------------------------------------------------------------------
def test_defaults_are_form_one_with_default_provenance():
    request = load()
    assert request.stages == {s.name: StageConfig() for s in BUILTIN_PIPELINE.stages}
    assert request.placement == PlacementConfig()
    assert request.source_of("talker", "process") == Provenance(Source.DEFAULT)


def test_the_file_then_the_cli_and_each_value_says_which_layer_set_it(tmp_path):
    path = yaml_file(tmp_path, "vocoder: {process: vocoder, gpu_memory_fraction: 0.05}\n"
                               "talker:\n  gpu_memory_fraction: 0.5\n"
                               "placement: {max_total_gpu_memory_fraction_per_gpu: 0.95}\n")
    request = load("--talker.gpu_memory_fraction", "0.85", file=path)
    assert request.stages["vocoder"] == StageConfig(process="vocoder", gpu_memory_fraction=0.05)
    assert request.stages["talker"].gpu_memory_fraction == 0.85  # the CLI wins
    assert request.placement.max_total_gpu_memory_fraction_per_gpu == 0.95
    assert request.source_of("vocoder", "process") == Provenance(Source.FILE, str(path))
    assert request.source_of("talker", "gpu_memory_fraction") == Provenance(
        Source.CLI, "--talker.gpu_memory_fraction")
    assert request.source_of("talker", "process") == Provenance(Source.DEFAULT)


def test_placement_fields_from_the_file_and_the_cli(tmp_path):
    path = yaml_file(tmp_path, "placement:\n  fused_stages: [[talker, vocoder]]\n"
                               "  cpu_device_memory_bytes: 8GiB\n")
    assert load(file=path).placement == PlacementConfig(fused_stages=(("talker", "vocoder"),),
                                                        cpu_device_memory_bytes=8 * 1024**3)
    cli = load("--placement.fused_stages", "preprocess,talker;vocoder").placement
    assert cli.fused_stages == (("preprocess", "talker"), ("vocoder",))
    assert load("--placement.fused_stages=", file=path).placement.fused_stages == ()  # off


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("device", "cuda:1", StageConfig(device="1")),
    ("device", "cpu", StageConfig(device="cpu")),
    ("devices", "0,cuda:1", StageConfig(devices=("0", "1"))),
    ("devices", "cpu,cpu", StageConfig(devices=("cpu", "cpu"))),
    ("tp_size", "2", StageConfig(tp_size=2)),
    ("replicas", "3", StageConfig(replicas=3)),
    ("gpu-memory-fraction", "1", StageConfig(gpu_memory_fraction=1.0)),  # dashes read too
])
def test_cli_values_are_parsed_and_normalised(flag, value, expected):
    assert load(f"--talker.{flag}", value).stages["talker"] == expected


def test_yaml_values_of_their_own_types(tmp_path):
    path = yaml_file(tmp_path, "talker: {device: 0, devices: [0, 'cuda:1'], tp_size: 2,\n"
                               "         gpu_memory_fraction: null}\n")
    assert load(file=path).stages["talker"] == StageConfig(device="0", devices=("0", "1"),
                                                           tp_size=2)


# --- problems --------------------------------------------------------------------------------
def test_unknown_names_come_with_the_closest_valid_one(tmp_path):
    path = yaml_file(tmp_path, "talkr: {process: t}\nplacement: {fused: []}\n")
    assert problems("--vocder.process", "v", "--talker.gpu_memory_fractoin", "0.5",
                    "--talker.zzz", "1", file=path) == [
        f"unknown stage 'talkr' in {path}; did you mean 'talker'?",
        f"unknown field 'fused' of placement in {path}; did you mean 'fused_stages'?",
        "unknown stage 'vocder' in --vocder.process; did you mean 'vocoder'?",
        "unknown field 'gpu_memory_fractoin' of stage talker in --talker.gpu_memory_fractoin; "
        "did you mean 'gpu_memory_fraction'?",
        "unknown field 'zzz' of stage talker in --talker.zzz; the fields are process, device, "
        "gpu_memory_fraction, tp_size, devices, replicas",
    ]


@pytest.mark.parametrize(("flag", "value", "must_be"), [
    ("talker.process", "a.b", "a process name of 1-64 letters, digits, '_' and '-'"),
    ("talker.process", "", "a process name of 1-64 letters, digits, '_' and '-'"),
    ("talker.device", "gpu0", "auto, cpu or a GPU index (0, cuda:0)"),
    ("talker.device", "-1", "auto, cpu or a GPU index (0, cuda:0)"),
    ("talker.gpu_memory_fraction", "0", "a number in (0, 1]"),
    ("talker.gpu_memory_fraction", "1.5", "a number in (0, 1]"),
    ("talker.gpu_memory_fraction", "nan", "a number in (0, 1]"),
    ("talker.tp_size", "0", "1-64"),
    ("talker.replicas", "2.5", "an integer 1-64"),
    ("talker.devices", "0,auto", "a list of devices, each cpu or a GPU index (0,1 or cpu,cpu)"),
    ("placement.max_total_gpu_memory_fraction_per_gpu", "2", "a number in (0, 1]"),
    ("placement.fused_stages", "talker,,vocoder",
     "a list of stage groups, e.g. [[talker, vocoder]] (CLI: talker,vocoder)"),
    ("placement.cpu_device_memory_bytes", "lots", "a size, e.g. 8GiB"),
])
def test_a_bad_cli_value_names_the_flag_as_given(flag, value, must_be):
    assert problems(f"--{flag}", value) == [f"--{flag} must be {must_be}, got {value!r}"]


def test_bad_yaml_values_name_the_file_and_key(tmp_path):
    path = yaml_file(tmp_path, "talker: {replicas: true, devices: 0}\n"
                               "placement: {fused_stages: [talker, vocoder]}\n")
    assert problems(file=path) == [
        f"{path}: talker.replicas must be an integer 1-64, got True",
        f"{path}: talker.devices must be a list of devices, each cpu or a GPU index "
        "(0,1 or cpu,cpu), got 0",
        f"{path}: placement.fused_stages must be a list of stage groups, e.g. "
        "[[talker, vocoder]] (CLI: talker,vocoder), got ['talker', 'vocoder']",
    ]


def test_invalid_yaml_says_the_line(tmp_path):
    path = yaml_file(tmp_path, "talker:\n  process: talker\n  device: [0\n")
    [problem] = problems(file=path)
    assert problem.startswith(f"{path}, line 4: not valid YAML (")


@pytest.mark.parametrize(("text", "problem"), [
    ("- talker\n", "{path}: the top level must be a mapping of stage names (and placement) to "
                   "their fields"),
    ("talker: talker\n", "{path}: talker must be a mapping of field: value, got str 'talker'"),
])
def test_the_file_must_be_mappings(tmp_path, text, problem):
    path = yaml_file(tmp_path, text)
    assert problems(file=path) == [problem.format(path=path)]


def test_a_missing_file_is_a_problem(tmp_path):
    path = tmp_path / "absent.yaml"
    assert problems(file=path) == [f"{path}: cannot read it (No such file or directory)"]


def test_an_empty_file_changes_nothing(tmp_path):
    assert load(file=yaml_file(tmp_path, "")) == load()


def test_every_problem_of_every_layer_at_once(tmp_path):
    path = yaml_file(tmp_path, "vocoder: {replicas: 0}\n")
    found = problems("--talker.tp_size", "x", "--preprocess.device", "gpu", file=path)
    assert len(found) == 3
    assert [p.split(" must be")[0] for p in found] == [
        f"{path}: vocoder.replicas", "--talker.tp_size", "--preprocess.device"]


# --- hostile and mistaken input: a problem, never a traceback --------------------------------
LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8))


@pytest.mark.parametrize(("text", "expected"), [
    (LAUGHS, "{path}, line 2: aliases (*name) are not supported in a placement file; write "
             "the value out"),
    ("talker: {process: &p t}\nvocoder: {process: *p}\n",
     "{path}, line 2: aliases (*name) are not supported in a placement file; write the value "
     "out"),
    ("placement: {fused_stages: " + "[" * 20_000 + "]" * 20_000 + "}\n",
     "{path}, line 1: nested deeper than 8 levels; a placement file maps stages to fields of "
     "plain values or lists"),
    ("talker: " + "{a: " * 20_000 + "1" + "}" * 20_000 + "\n",
     "{path}, line 1: nested deeper than 8 levels; a placement file maps stages to fields of "
     "plain values or lists"),
    ("talker: {tp_size: 2}\nvocoder: {}\ntalker: {tp_size: 4}\n",
     "{path}, line 3: duplicate key 'talker' (first on line 1); keep one"),
    ("talker:\n  tp_size: 2\n  tp_size: 4\n",
     "{path}, line 3: duplicate key 'tp_size' (first on line 2); keep one"),
    ("talker: {tp_size: 2, tp-size: 4}\n",
     "{path}: talker.tp_size is set twice (as 'tp_size' and 'tp-size'); keep one"),
    ("talker: {process: t}\nvocoder: {process: 2024-02-30}\n",
     "{path}, line 2: cannot read this value (day is out of range for month)"),
])
def test_a_hostile_or_ambiguous_file_is_one_clean_problem(tmp_path, text, expected):
    path = yaml_file(tmp_path, text)
    assert problems(file=path) == [expected.format(path=path)]


def test_an_integer_no_constructor_can_make_is_a_problem_with_its_line(tmp_path):
    path = yaml_file(tmp_path, "talker: {process: t}\nvocoder: {replicas: " + "9" * 5000 + "}\n")
    [problem] = problems(file=path)
    assert problem.startswith(f"{path}, line 2: cannot read this value (") and len(problem) < 300


def test_a_path_no_file_can_have_is_a_problem():
    assert problems(file=Path("a\0b")) == ["a\0b: cannot read it (embedded null byte)"]


LONG = "x" * 100_000


@pytest.mark.parametrize(("flags", "text"), [
    (("--talker.process", LONG), None),
    (("--talker.tp_size", LONG), None),
    ((f"--{LONG}.process", "t"), None),
    ((f"--talker.{LONG}", "t"), None),
    ((), f"talker: {{process: {LONG}}}\n"),
    ((), f"talker: [{', '.join(['1'] * 20_000)}]\n"),
    ((), f"{LONG[:1000]}: {{process: t}}\n"),  # a YAML key is at most 1024 characters
    ((), f"talker: {{{LONG[:1000]}: t}}\n"),
    ((), "talker: {tp_size: 0x" + "f" * 5000 + "}\n"),  # hex: int() has no digit limit
    ((), f"talker: {{x_{LONG[:1000]}: 1, x-{LONG[:1000]}: 2}}\n"),  # one field, spelt twice
])
def test_a_message_quotes_a_raw_value_briefly(tmp_path, flags, text):
    found = problems(*flags, file=yaml_file(tmp_path, text) if text else None)
    assert found and all(len(p) < 300 + len(str(tmp_path)) for p in found), found[0][:400]


# --- bounded integers, ASCII digits ----------------------------------------------------------
@pytest.mark.parametrize("field", ["tp_size", "replicas"])
def test_counts_are_at_most_64_and_the_message_says_so(tmp_path, field):
    assert getattr(load(f"--talker.{field}", "64").stages["talker"], field) == 64
    assert problems(f"--talker.{field}", "65") == [f"--talker.{field} must be 1-64, got '65'"]
    assert problems(f"--talker.{field}", "-1") == [f"--talker.{field} must be 1-64, got '-1'"]
    assert problems(f"--talker.{field}", "9" * 5000)[0].startswith(
        f"--talker.{field} must be 1-64, got '99999")
    assert load(f"--talker.{field}", "0" * 5000 + "2").stages["talker"] == StageConfig(
        **{field: 2})  # int() would refuse the 5,001 digits
    path = yaml_file(tmp_path, f"talker: {{{field}: 100000000000000000000000}}\n")
    assert problems(file=path) == [
        f"{path}: talker.{field} must be 1-64, got 100000000000000000000000"]


@pytest.mark.parametrize(("flag", "value", "must_be"), [
    ("talker.tp_size", "²", "an integer 1-64"),  # str.isdigit() says yes, int() says no
    ("talker.replicas", "٣", "an integer 1-64"),  # int() reads it as 3
    ("talker.tp_size", "1_0", "an integer 1-64"),  # int() reads it as 10
    ("talker.gpu_memory_fraction", "٠.٥", "a number in (0, 1]"),  # float() reads it as 0.5
    ("talker.device", "cuda:٣", "auto, cpu or a GPU index (0, cuda:0)"),
    ("talker.device", "9" * 5000, "auto, cpu or a GPU index (0, cuda:0)"),
    ("talker.process", "t\n", "a process name of 1-64 letters, digits, '_' and '-'"),
    ("placement.cpu_device_memory_bytes", "٣GiB", "a size, e.g. 8GiB"),
])
def test_only_ascii_digits_are_numbers(flag, value, must_be):
    assert problems(f"--{flag}", value) == [f"--{flag} must be {must_be}, got {brief(value)}"]


def test_huge_yaml_integers_are_problems_in_every_field(tmp_path):
    huge = 10**23
    path = yaml_file(tmp_path, f"talker: {{device: {huge}, devices: [0, {huge}], tp_size: {huge},"
                               f" gpu_memory_fraction: {huge}}}\n"
                               f"placement: {{cpu_device_memory_bytes: {huge},"
                               f" max_total_gpu_memory_fraction_per_gpu: {huge}}}\n")
    found = problems(file=path)
    assert [p.split(" must be ")[0] for p in found] == [
        f"{path}: talker.{f}" for f in ("device", "devices", "tp_size", "gpu_memory_fraction")
    ] + [f"{path}: placement.{f}" for f in ("cpu_device_memory_bytes",
                                             "max_total_gpu_memory_fraction_per_gpu")]
    assert all(p.endswith(f"got {huge}") or p.endswith(f"{huge}]") for p in found)


@pytest.mark.parametrize(("value", "ok"), [
    ("0", False), ("1", True), (str(2**60), True), (str(2**60 + 1), False),
    ("1048576TiB", True), ("1048577TiB", False), ("9" * 5000, False),
])
def test_cpu_device_memory_bytes_is_1_byte_to_1_eib(value, ok):
    flag = "--placement.cpu_device_memory_bytes"
    if ok:
        assert 1 <= load(flag, value).placement.cpu_device_memory_bytes <= 2**60
    else:
        assert problems(flag, value) == [
            f"{flag} must be a size of 1 byte to 1 EiB (2**60 bytes), e.g. 8GiB, got "
            f"{brief(value)}"]


def test_a_zero_size_in_the_file_is_a_problem_not_the_hosts_memory(tmp_path):
    path = yaml_file(tmp_path, "placement: {cpu_device_memory_bytes: 0}\n")
    assert problems(file=path) == [
        f"{path}: placement.cpu_device_memory_bytes must be a size of 1 byte to 1 EiB (2**60 "
        "bytes), e.g. 8GiB, got 0"]
