"""The command line as a person meets it: help, bad options (exit 2, no traceback), weights."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import click
import pytest

from omni_dp.engine.config import CONFIG_FILE, WEIGHTS_FILE
from omni_dp.sizes import parse_size

from support.http_client import post_json


def omni_dp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_dp", *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


NOTHING_THERE = [
    (["status"], 1), (["status", "nope"], 1), (["status", "nope", "--json"], 1),
    (["logs"], 1), (["logs", "nope"], 1),
    (["verify-mps"], 1), (["verify-mps", "nope"], 1), (["verify-mps", "--overlap"], 1),
    (["restart", "nope"], 1), (["scale", "nope", "-n", "2"], 1),
    (["top"], 1), (["top", "nope", "--once"], 1),
    (["down"], 0), (["down", "nope"], 0), (["list"], 0),
    (["status", "../etc"], 2),  # not "nothing there": not a run id at all
]


@pytest.mark.parametrize(("args", "code"), NOTHING_THERE)
def test_nothing_there_is_1_where_a_run_is_read_and_0_for_down(tmp_path, monkeypatch, args,
                                                               code):
    """No run at all, or none of that id: the question has an answer (exit 1 where a run is
    read, 0 for `down`: nothing to stop); 2 stays for input wrong in itself."""
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path))
    result = omni_dp(*args)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    if code == 1:
        assert len(result.stderr.strip().splitlines()) == 1  # one line saying what is not there


def test_help_lists_commands():
    result = omni_dp("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout
    assert "save-weights" in result.stdout


def test_serve_help_documents_every_flag():
    from omni_dp.cli import serve

    result = omni_dp("serve", "--help")
    assert result.returncode == 0
    for param in serve.params:
        for flag in param.opts:
            assert flag in result.stdout
        assert param.help, f"{param.opts[0]} has no help text"


def test_help_does_not_import_torch():
    code = "import sys; from omni_dp.cli import cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"


_HELP_IMPORTS = """
import contextlib, io, json, sys
from omni_dp.cli import main
sys.argv = ["omni-dp", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main()
print(json.dumps({"help": out.getvalue(), "torch": "torch" in sys.modules,
                  "commands": sorted(m for m in sys.modules if m.startswith("omni_dp.cli."))}))
"""


@pytest.mark.parametrize("args", [["--help"], ["launch", "--help"]])
def test_help_of_the_top_level_and_of_launch_does_not_import_torch(args):
    result = subprocess.run([sys.executable, "-c", _HELP_IMPORTS, *args], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert "Usage: omni-dp" in seen["help"]
    assert seen["torch"] is False
    if args == ["--help"]:  # rendered from the table: no command module is imported
        assert seen["commands"] == ["omni_dp.cli.common"], seen["commands"]
    else:
        assert "omni_dp.cli.commands.launch" in seen["commands"]


def test_the_commands_table_lists_every_command_with_its_own_short_help():
    from omni_dp.cli import CLI_COMMANDS, cli

    result = omni_dp("--help")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines()
              if line.strip()]
    assert listed == sorted(CLI_COMMANDS)
    eager = click.Group(cli.name, help=cli.help, params=cli.params,
                        context_settings=cli.context_settings)
    for name, entry in CLI_COMMANDS.items():
        command = cli.get_command(None, name)
        assert isinstance(command, click.Command), name
        assert command.get_short_help_str(10**6) == entry.short_help, name
        eager.add_command(command, name)
    for width in (60, 80, 100, 200):  # the table renders exactly what click would
        def render(group, width=width):
            # the group's own settings, as make_context applies them (-h, --help; width 100):
            # else the result hangs on whether an earlier test already invoked `cli` in this
            # process (click keeps the help option of the first context it made)
            ctx = click.Context(group, info_name="omni-dp", terminal_width=width,
                                **group.context_settings)
            return group.get_help(ctx)

        assert render(cli) == render(eager)


# --- --help in titled sections: every option in exactly one -----------------------------------
SECTIONED = ("launch", "serve", "router")


def _sectioned(name: str):
    """The command, and a context as `omni-dp NAME` makes one (-h, --help; at most 100
    columns)."""
    from omni_dp.cli import cli

    command = cli.get_command(None, name)
    return command, lambda width: click.Context(command, info_name=f"omni-dp {name}",
                                                terminal_width=width, **cli.context_settings)


@pytest.mark.parametrize("name", SECTIONED)
def test_every_option_names_one_of_its_commands_sections(name):
    """A new flag without a section (a field's metadata "section", or `section=` on a written
    option) fails here, before its help would list it under "Other options"."""
    from omni_dp.cli.common import SectionedCommand

    command, context = _sectioned(name)
    assert isinstance(command, SectionedCommand)
    ctx = context(80)
    unsectioned = [param.opts[0] for param in command.get_params(ctx)
                   if isinstance(param, click.Option) and not param.hidden
                   and command.section_of(ctx, param) not in command.sections]
    assert not unsectioned, f"{name}: options in no section of {command.sections}"


def _help_rows(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """The section titles of a help text, in order, and each flag -> the sections whose rows
    list it (a row starts 2 columns in, its flags end at 2 spaces or the line's end)."""
    titles: list[str] = []
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if re.fullmatch(r"\S.*:", line):
            titles.append(line[:-1])
        elif titles and re.match(r"  -", line):
            term = re.split(r"\s{2,}", line.strip())[0]
            for declared in term.split(", "):
                rows.setdefault(declared.split()[0], []).append(titles[-1])
    return titles, rows


@pytest.mark.parametrize("width", [80, 100])
@pytest.mark.parametrize("name", SECTIONED)
def test_help_shows_each_section_title_and_every_option_once_in_its_section(name, width):
    from omni_dp.cli.common import OTHER_OPTIONS

    command, context = _sectioned(name)
    ctx = context(width)
    text = command.get_help(ctx)
    titles, rows = _help_rows(text)
    assert OTHER_OPTIONS not in titles, f"{name}: an option names no section of its command"
    assert titles == list(command.sections), f"{name}: each title once, in order"
    expected = {flag: [command.section_of(ctx, param)]
                for param in command.get_params(ctx)
                if isinstance(param, click.Option) and not param.hidden
                for flag in (*param.opts, *param.secondary_opts)}
    assert rows == expected, f"{name}: every flag once, in its own section"
    assert max(map(len, text.splitlines())) <= width, f"{name}: wider than {width} columns"


def test_an_option_naming_no_section_is_still_shown_under_other_options():
    """The tests above keep the real commands free of it; should one slip through, its help is
    still listed (last), never dropped."""
    from omni_dp.cli.common import OTHER_OPTIONS, SectionedCommand, SectionOption

    command = SectionedCommand(
        "demo", sections=("First", "Last"), help_section="Last",
        params=[click.Option(["--plain"], help="Names none."),
                SectionOption(["--typo"], section="Firts", help="Names an unlisted one."),
                SectionOption(["--kept"], section="First", help="Listed.")])
    titles, rows = _help_rows(command.get_help(click.Context(command, terminal_width=80)))
    assert titles == ["First", "Last", OTHER_OPTIONS]
    assert rows == {"--kept": ["First"], "--help": ["Last"], "--plain": [OTHER_OPTIONS],
                    "--typo": [OTHER_OPTIONS]}


def test_every_command_loads_by_name_and_as_an_attribute():
    import omni_dp.cli
    from omni_dp.cli import CLI_COMMANDS

    for name, entry in CLI_COMMANDS.items():
        attribute = entry.target.partition(":")[2]
        command = getattr(omni_dp.cli, attribute)
        assert isinstance(command, click.Command) and command.name == name
    with pytest.raises(AttributeError):
        _ = omni_dp.cli.no_such_command


# --- every default written once: the options are generated from the settings dataclasses ---


def _generated_defaults(command, *dataclasses_with_prefix):
    """(flag, click default, dataclass default) for every flag field, and the options whose
    name is a field's but that were not generated from it (a second home of a default)."""
    from omni_dp.cli.common import FieldOption, cli_fields

    options = {p.name: p for p in command.params}
    pairs, second_homes = [], []
    for cls, prefix in dataclasses_with_prefix:
        for f in cli_fields(cls):
            option = options[prefix + f.name]
            if not isinstance(option, FieldOption) or option.field is not f:
                second_homes.append(option.opts[0])
                continue
            default = option.default
            if f.metadata.get("size") and default is not None:
                default = parse_size(default)
            if f.metadata.get("invert"):
                default = not default
            pairs.append((option.opts[0], default, f.default))
    return pairs, second_homes


def _commands_and_settings():
    from omni_dp.cli import launch, router, serve
    from omni_dp.engine.options import ServeOptions
    from omni_dp.launcher.planning.options import LaunchOptions
    from omni_dp.router.config import HealthConfig, RouterConfig

    return {"serve": (serve, [(ServeOptions, "")]),
            "router": (router, [(RouterConfig, ""), (HealthConfig, "health_")]),
            "launch": (launch, [(LaunchOptions, "")])}


@pytest.mark.parametrize("name", ["serve", "router", "launch"])
def test_every_option_default_is_the_dataclass_field_default(name):
    command, settings = _commands_and_settings()[name]
    pairs, second_homes = _generated_defaults(command, *settings)
    assert not second_homes, f"written by hand, not generated from the dataclass: {second_homes}"
    assert len(pairs) >= 15
    for flag, click_default, field_default in pairs:
        assert click_default == field_default, flag


def test_save_weights_takes_its_defaults_from_serve():
    from omni_dp.cli import save_weights
    from omni_dp.engine.options import ServeOptions

    defaults = {p.name: p.default for p in save_weights.params}
    # save-weights writes a seeded preset; serve's default is the trained voice (or auto's
    # fallback, tiny)
    assert defaults["model"] == "tiny" and ServeOptions.model == "auto"
    assert defaults["weight_seed"] == ServeOptions.weight_seed == 0


def test_the_serve_options_agree_with_the_engine():
    from omni_dp.engine import kv_cache, plan
    from omni_dp.engine.options import DTYPE_NAMES, ServeOptions

    assert ServeOptions().page_size == kv_cache.DEFAULT_PAGE_SIZE
    assert tuple(plan.DTYPES) == DTYPE_NAMES
    assert plan.ServeOptions is ServeOptions  # still importable from where it was


def test_plan_errors_are_problems():
    from omni_dp.contract import Problems
    from omni_dp.engine.plan import ServePlanError
    from omni_dp.router.config import RouterConfigError

    for error in (ServePlanError, RouterConfigError):
        raised = error(["one", "two"])
        assert isinstance(raised, Problems) and isinstance(raised, ValueError)
        assert raised.problems == ["one", "two"] and str(raised) == "one\ntwo"


# --- launch's start-up flags, renamed apart from the router's health flags --------------------


@pytest.fixture
def launch_options(monkeypatch):
    """Run `omni-dp launch ARGS` in process up to its plan: (the options it would plan with,
    its stderr). Nothing is read of the machine, nothing started."""
    from click.testing import CliRunner

    from omni_dp.cli import cli

    seen = []

    def planned(options, problems):
        seen.append((options, problems))
        sys.exit(0)

    monkeypatch.setattr("omni_dp.cli.commands.launch._plan", planned)

    def run(*args: str):
        result = CliRunner().invoke(cli, ["launch", *args], prog_name="omni-dp")
        assert result.exit_code == 0, result.output
        options, problems = seen.pop()
        assert problems == []
        return options, result.stderr

    return run


DEPRECATED = "is deprecated (it goes in the next release); use"


def test_launch_start_timeout_and_restart_after_failures(launch_options):
    options, stderr = launch_options("--start-timeout", "7", "--restart-after-failures", "4")
    assert (options.start_timeout, options.restart_after_failures) == (7.0, 4)
    assert DEPRECATED not in stderr
    defaults, _ = launch_options()
    # no --start-timeout: the engine's own default (the plan's start_timeout)
    assert (defaults.start_timeout, defaults.restart_after_failures) == (None, 3)


def test_launch_old_spellings_still_work_with_a_warning(launch_options):
    options, stderr = launch_options("--health-timeout", "7", "--health-failures", "4")
    assert (options.start_timeout, options.restart_after_failures) == (7.0, 4)
    warnings = [line for line in stderr.splitlines() if DEPRECATED in line]
    assert warnings == [
        f"omni-dp launch: --health-timeout {DEPRECATED} --start-timeout",
        f"omni-dp launch: --health-failures {DEPRECATED} --restart-after-failures"]
    both, stderr = launch_options("--start-timeout", "5", "--health-timeout", "9")
    assert both.start_timeout == 5.0 and DEPRECATED in stderr  # the new spelling wins


@pytest.mark.parametrize("key", ["health-timeout", "health_timeout"])
def test_launch_config_file_old_key_still_works_with_a_warning(launch_options, tmp_path, key):
    config = tmp_path / "launch.yaml"
    config.write_text(f"{key}: 9\nrestart-after-failures: 6\n")
    options, stderr = launch_options("--config", str(config))
    assert (options.start_timeout, options.restart_after_failures) == (9.0, 6)
    assert f"omni-dp launch: --config {config}: {key} {DEPRECATED} start-timeout" in stderr
    flag_wins, _ = launch_options("--config", str(config), "--start-timeout", "11")
    assert flag_wins.start_timeout == 11.0


def test_launch_json_in_the_foreground_is_refused_with_what_to_use(monkeypatch):
    from click.testing import CliRunner

    from omni_dp.cli import cli

    seen = []
    monkeypatch.setattr("omni_dp.cli.commands.launch._plan",
                        lambda options, problems: (seen.append(problems), sys.exit(2)))
    CliRunner().invoke(cli, ["launch", "--json"], prog_name="omni-dp")
    assert any(p.startswith("--json needs --dry-run (the plan) or --detach") for p in seen[-1])
    for args in (["--json", "--detach"], ["--json", "--dry-run"]):
        CliRunner().invoke(cli, ["launch", *args], prog_name="omni-dp")
        assert not [p for p in seen[-1] if p.startswith("--json needs")], args


def test_launch_config_file_new_and_old_key_together_are_set_twice(tmp_path):
    from omni_dp.launcher.planning.options import load_config_file

    problems: list[str] = []
    config = tmp_path / "launch.yaml"
    config.write_text("start-timeout: 5\nhealth_timeout: 9\n")
    load_config_file(str(config), problems)
    assert problems == [f"--config {config}: start-timeout is set twice (as 'start-timeout' "
                        "and 'health_timeout'); keep one"]


def test_launch_help_shows_the_new_flags_only_and_the_router_keeps_its_own():
    launch_help = omni_dp("launch", "--help").stdout
    assert "--start-timeout" in launch_help and "--restart-after-failures" in launch_help
    assert "--health-timeout FLOAT" not in launch_help
    assert "--health-failures INTEGER" not in launch_help
    router_help = omni_dp("router", "--help").stdout
    assert "--health-timeout FLOAT" in router_help and "--health-failures INTEGER" in router_help
    assert "--start-timeout" not in router_help


def test_launch_dry_run_with_old_spellings_plans_the_same_run(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("health_failures: 4\n")
    args = ["launch", "--gpu", "none", "--max-total-tokens", "1024", "--dry-run", "--json",
            "--base-port", "18100", "--router-port", "18000"]
    old = omni_dp(*args, "--health-timeout", "7", "--config", str(config))
    new = omni_dp(*args, "--start-timeout", "7", "--restart-after-failures", "4")
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert "--health-timeout is deprecated" in old.stderr
    assert "health_failures is deprecated" in old.stderr
    assert "deprecated" not in new.stderr
    supervision = json.loads(old.stdout)["supervision"]
    assert (supervision["health_timeout"], supervision["health_failures"]) == (7.0, 4)
    assert json.loads(new.stdout)["supervision"] == supervision


BAD_OPTIONS = [
    (["--kv-cache-bytes", "1GiB", "--max-total-tokens", "4096"], "give only one"),
    (["--kv-cache-bytes", "lots"], "is not a size"),
    (["--kv-cache-bytes", "100"], "holds no whole page"),
    (["--max-total-tokens", "1000"], "use 992 or 1008"),
    (["--max-total-tokens", "-16"], "must be positive"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--device", "tpu"], "is not a device"),
    (["--device", "mps"], "not supported"),
    (["--model", "/nonexistent/model"], "neither a preset"),
    (["--threads", "0"], "--threads"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--kv-cache-bytes", "1000TiB"], "lower --kv-cache-bytes"),
    (["--dtype", "int8"], "int8"),
]


@pytest.fixture
def serve_in_process(monkeypatch):
    """`omni-dp serve ARGS` run in this process (the engine imported once for every case, not
    once per process), whose server must never start: a plan that passed is a failure."""
    from click.testing import CliRunner

    from omni_dp.cli import cli

    def started(plan):
        raise AssertionError("the options passed: the server would have started")

    monkeypatch.setattr("omni_dp.engine.server.serve", started)
    return lambda *args: CliRunner().invoke(cli, ["serve", *args], prog_name="omni-dp")


@pytest.mark.parametrize(("args", "message"), BAD_OPTIONS)
def test_bad_options_exit_2_with_a_message_and_no_traceback(serve_in_process, args, message):
    result = serve_in_process("--port", "0", *args)
    assert result.exit_code == 2, result.exception  # a raised error is exit 1, not 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_several_problems_are_reported_together():
    """As a process: exit 2, one line per problem, no traceback, nothing started."""
    result = omni_dp("serve", "--device", "cuda", "--max-total-tokens", "1000", "--threads", "0")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 3
    assert "Traceback" not in result.stderr
    assert "listening" not in result.stderr


def test_port_in_use_exits_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = omni_dp("serve", "--port", str(port))
    assert result.returncode == 2
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_dir_with_a_broken_config_exits_2(tmp_path, serve_in_process):
    (tmp_path / CONFIG_FILE).write_text('{"architecture": "something-else"}')
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    result = serve_in_process("--model", str(tmp_path))
    assert result.exit_code == 2, result.exception
    assert "architecture" in result.stderr


def test_saved_weights_serve_the_same_audio_as_the_preset(tmp_path, replica, start_replica):
    weights = tmp_path / "tiny-seed0"
    result = omni_dp("save-weights", str(weights))
    assert result.returncode == 0, result.stderr
    assert (weights / CONFIG_FILE).is_file()
    assert (weights / WEIGHTS_FILE).is_file()

    again = omni_dp("save-weights", str(weights))
    assert again.returncode == 2
    assert "--force" in again.stderr

    from_dir = start_replica("--model", str(weights))
    assert from_dir.info()["model"]["source"] == str(weights)
    body = {"input": "Loaded from disk.", "seed": 99}
    assert post_json(from_dir.url + "/v1/audio/speech", body)[2] == \
        post_json(replica.url + "/v1/audio/speech", body)[2]


def test_other_weight_seed_gives_other_audio(replica, start_replica):
    other = start_replica("--weight-seed", "1")
    body = {"input": "Different weights.", "seed": 5}
    first = post_json(replica.url + "/v1/audio/speech", body)
    second = post_json(other.url + "/v1/audio/speech", body)
    assert first[0] == second[0] == 200
    assert first[2] != second[2]


def test_policy_names_agree_everywhere():
    """`--policy` of router and launch, the launcher's plan and the router itself."""
    from omni_dp.cli.common import POLICIES
    from omni_dp.launcher.planning import checks
    from omni_dp.router import policies

    assert set(POLICIES) == set(checks.POLICIES) == set(policies.POLICIES)


def test_log_formats_agree_everywhere():
    from omni_dp import logs
    from omni_dp.cli.common import LOG_FORMATS

    assert LOG_FORMATS == logs.LOG_FORMATS
