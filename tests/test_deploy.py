"""deploy/ cannot rot: every YAML document under it (but kustomize's kustomization.yaml, checked
on its own, and deploy/grafana/'s Grafana and Prometheus files, tests/test_dashboard.py's)
validates against the Kubernetes schemas (kubernetes-validate, strict: an unknown or misspelt
field fails), and the Kubernetes recipe keeps the promises omni-dp needs from its pod,
checked against omni-dp's own code where it has one (the --config reader, the CLI, the
teardown bound, the state directory and MPS socket checks).

deploy/Dockerfile, which no docker engine here can build, is parsed with BuildKit's own parser
(the `dockerfile` package) and held to what it and deploy/README.md say: the CUDA runtime base
a build argument, the repository copied in and installed by scripts/setup, numactl, no driver
programs, the pod's user, omni-dp as the entrypoint; and a few of hadolint's rules.

kubernetes-validate and dockerfile are in the test extra (scripts/setup --test installs them),
so a missing one fails the import here, in CI as anywhere: these tests never skip (but the
check of the render against `kubectl kustomize`, where kubectl is not installed).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
import stat
import subprocess
import types
from pathlib import Path, PurePosixPath

import dockerfile
import kubernetes_validate
import pytest
import yaml

from omni_dp.files import make_private_dir, private_dir_problem
from omni_dp.launcher.planning.facts import new_run_id
from omni_dp.launcher.planning.options import FIELDS, LaunchOptions, load_config_file
from omni_dp.launcher.teardown import owner_bound
from omni_dp.mps.control import socket_path_problems
from omni_dp.rundir import mps_pipe_dir, run_dir

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RECIPE = DEPLOY / "kubernetes"
# The oldest Kubernetes the recipe claims (its preStop `sleep` is on by default from 1.30) and
# the newest that kubernetes-validate 1.37.0 ships schemas for.
KUBERNETES_VERSIONS = ("1.30", "1.37")
KUSTOMIZATION = "kustomization.yaml"  # kustomize's own file, no Kubernetes object
GRAFANA = DEPLOY / "grafana"  # Grafana's and Prometheus's files, no Kubernetes objects
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _yaml_files(root: Path = DEPLOY) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def _documents() -> list[tuple[Path, int, dict]]:
    """Every YAML document under deploy/ (each a mapping; empty documents are refused too)."""
    found = []
    for path in _yaml_files():
        if path.is_relative_to(GRAFANA):
            continue
        with path.open(encoding="utf-8") as f:
            for index, doc in enumerate(yaml.safe_load_all(f)):
                assert isinstance(doc, dict), f"{path.relative_to(ROOT)} document {index} is " \
                    f"not a mapping: {doc!r}"
                found.append((path, index, doc))
    return found


DOCUMENTS = _documents()
OBJECTS = [(p, i, d) for p, i, d in DOCUMENTS if p.name != KUSTOMIZATION]
LOCAL_CONFIG = "config.kubernetes.io/local-config"  # kustomize's: an input, never applied


# --- what `kubectl apply -k` applies ----------------------------------------------------------


def _path(field_path: str) -> list[str]:
    """A kustomize fieldPath's segments: `a.b`, `[key.with.dots]`, `[name=value]` (a list item)."""
    segments, current, depth = [], "", 0
    for char in field_path:
        depth += (char == "[") - (char == "]")
        if char == "." and depth == 0:
            segments.append(current)
            current = ""
        else:
            current += char
    return [*segments, current]


def _step(node, segment: str):
    if segment.startswith("[") and "=" in segment:
        key, _, value = segment[1:-1].partition("=")
        items = [item for item in node if item.get(key) == value]
        assert len(items) == 1, f"{segment}: {len(items)} list items match"
        return items[0]
    key = segment[1:-1] if segment.startswith("[") else segment
    assert key in node, f"no field {key!r}: kustomize would refuse the path"
    return node[key]


def _field(doc: dict, field_path: str):
    node = doc
    for segment in _path(field_path):
        node = _step(node, segment)
    return node


def _set_field(doc: dict, field_path: str, value) -> None:
    *parents, last = _path(field_path)
    node = doc
    for segment in parents:
        node = _step(node, segment)
    _step(node, last)  # the field exists (no `create` option here)
    node[last[1:-1] if last.startswith("[") else last] = value


def _selects(select: dict, doc: dict) -> bool:
    return all((doc.get("metadata", {}).get(k) if k in ("name", "namespace") else doc.get(k))
               == v for k, v in select.items())


def _render(recipe: Path = RECIPE) -> list[tuple[Path, int, dict]]:
    """The objects of the kustomization in `recipe` as kustomize builds them, for what of
    kustomize the recipe uses: its `resources`, `replacements` (from one object's field into
    others') and local-config objects left out. tests below check it against `kubectl
    kustomize` where kubectl is installed."""
    kustomization = yaml.safe_load((recipe / KUSTOMIZATION).read_text(encoding="utf-8"))
    known = {"apiVersion", "kind", "resources", "replacements"}
    assert set(kustomization) <= known, f"kustomize features the test does not render: " \
        f"{sorted(set(kustomization) - known)}"
    found = []
    for name in kustomization["resources"]:
        with (recipe / name).open(encoding="utf-8") as f:
            found += [(recipe / name, i, d) for i, d in enumerate(yaml.safe_load_all(f))]
    for replacement in kustomization.get("replacements", []):
        source = replacement["source"]
        origins = [d for _, _, d in found if _selects(
            {k: v for k, v in source.items() if k != "fieldPath"}, d)]
        assert len(origins) == 1, f"replacement source {source}: {len(origins)} objects"
        value = _field(origins[0], source["fieldPath"])
        for target in replacement["targets"]:
            docs = [d for _, _, d in found if _selects(target["select"], d)]
            assert docs, f"replacement target {target['select']} selects nothing"
            for doc in docs:
                for field_path in target["fieldPaths"]:
                    _set_field(doc, field_path, value)
    return [(p, i, d) for p, i, d in found
            if d.get("metadata", {}).get("annotations", {}).get(LOCAL_CONFIG) != "true"]


RENDERED = _render()


def _only(kinds: tuple[str, ...], rendered=None) -> dict:
    matches = [d for p, _, d in rendered or RENDERED
               if p.parent.name == RECIPE.name and d.get("kind") in kinds]
    assert len(matches) == 1, f"deploy/kubernetes/ must hold exactly one of {kinds}, has " \
        f"{len(matches)}"
    return matches[0]


def _named_in(documents, kind: str, name: str) -> dict:
    matches = [d for _, _, d in documents if d.get("kind") == kind
               and d.get("metadata", {}).get("name") == name]
    assert len(matches) == 1, f"no single {kind} named {name!r} in deploy/"
    return matches[0]


def _named(kind: str, name: str) -> dict:
    return _named_in(RENDERED, kind, name)


# --- the recipe, read the way the kubelet and omni-dp will --------------------------------


@dataclasses.dataclass
class Recipe:
    workload: dict
    pod: dict  # the pod template's spec
    container: dict  # the one that runs `omni-dp launch`
    args: list[str]  # what follows `launch`
    config_text: str  # the --config file, as the ConfigMap holds it

    @property
    def flags(self) -> dict[str, str | bool]:
        """The launch flags given on the command line, by setting name: a flag followed by a
        value, or alone (a switch)."""
        found: dict[str, str | bool] = {}
        args = self.args[:self.args.index("--")] if "--" in self.args else self.args
        i = 0
        while i < len(args):
            arg = args[i]
            assert arg.startswith("--"), f"stray argument {arg!r} in the launch command"
            name, eq, value = arg[2:].partition("=")
            key = name.replace("-", "_")
            field = FIELDS.get(key)
            if eq:
                found[key] = value
            elif field is not None and field.type == "bool":
                found[key] = True
            else:
                assert i + 1 < len(args), f"{arg} has no value"
                found[key] = args[i + 1]
                i += 1
            i += 1
        return found

    def file_values(self, tmp_path: Path) -> tuple[dict, list[str], list[str]]:
        """The --config file through omni-dp's own reader: (values by field, problems,
        deprecation warnings)."""
        path = tmp_path / "launch.yaml"
        path.write_text(self.config_text, encoding="utf-8")
        problems: list[str] = []
        deprecations: list[str] = []
        return load_config_file(str(path), problems, deprecations), problems, deprecations

    def setting(self, name: str, tmp_path: Path):
        """A setting's value as the launch will have it: the flag, else the file, else the
        default."""
        if name in self.flags:
            return self.flags[name]
        values, problems, _ = self.file_values(tmp_path)
        assert not problems, problems
        field = FIELDS[name]
        if values.get(field.name) is not None:
            return values[field.name]
        return getattr(LaunchOptions(), field.name)

    @property
    def gpus(self) -> int:
        return int(self.container["resources"]["limits"]["nvidia.com/gpu"])

    @property
    def replicas(self) -> int:
        return self.gpus * int(self.flags["replicas_per_gpu"])

    def env(self, name: str) -> str:
        values = [e for e in self.container.get("env", []) if e["name"] == name]
        assert len(values) == 1 and "value" in values[0], f"{name} must be set once, literally"
        return values[0]["value"]

    def port(self, port: int | str) -> int:
        """A probe's or Service's port: a number, or the name of a container port."""
        if isinstance(port, int):
            return port
        numbers = [p["containerPort"] for p in self.container.get("ports", [])
                   if p.get("name") == port]
        assert numbers, f"the container has no port named {port!r}"
        return numbers[0]


def _launch_container(pod: dict) -> tuple[dict, list[str]]:
    for container in pod["containers"]:
        argv = [*container.get("command", []), *container.get("args", [])]
        if "launch" in argv and any(PurePosixPath(a).name == "omni-dp" for a in argv):
            return container, argv
    raise AssertionError("no container runs `omni-dp launch`")


def _recipe() -> Recipe:
    workload = _only(("DaemonSet", "Deployment"))
    pod = workload["spec"]["template"]["spec"]
    container, argv = _launch_container(pod)
    args = argv[argv.index("launch") + 1:]
    assert "--config" in args, "the launch command must read its settings with --config"
    config_path = PurePosixPath(args[args.index("--config") + 1])
    mounts = [m for m in container.get("volumeMounts", [])
              if config_path.parent == PurePosixPath(m["mountPath"])]
    assert mounts, f"no volume is mounted where --config {config_path} lives"
    volume = next(v for v in pod["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in volume, f"--config {config_path} must come from a ConfigMap"
    key = config_path.name
    for item in volume["configMap"].get("items", []):
        if item["path"] == key:
            key = item["key"]
    config_map = _named("ConfigMap", volume["configMap"]["name"])
    assert key in config_map.get("data", {}), f"the ConfigMap has no key {key!r}"
    return Recipe(workload, pod, container, args, config_map["data"][key])


# --- the schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize(("path", "index", "doc"), OBJECTS,
                         ids=[f"{p.relative_to(DEPLOY)}#{i}" for p, i, _ in OBJECTS])
def test_every_manifest_is_valid_for_kubernetes(path, index, doc, version):
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(str(part) for part in exc.path) or "(top level)"
        pytest.fail(f"{path.relative_to(ROOT)} document {index} is not a valid "
                    f"{doc.get('kind')} for Kubernetes {version} at {where}: {exc.message}")
    except kubernetes_validate.SchemaNotFoundError as exc:
        pytest.fail(f"{path.relative_to(ROOT)} document {index}: {exc.message}")


def test_there_are_manifests_to_validate():
    kinds = {d["kind"] for _, _, d in OBJECTS}
    assert {"DaemonSet", "Service", "ConfigMap"} <= kinds, kinds


def test_kustomization_applies_every_manifest():
    """`kubectl apply -k deploy/kubernetes` must not leave a manifest behind."""
    kustomization = yaml.safe_load((RECIPE / KUSTOMIZATION).read_text(encoding="utf-8"))
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization.get("resources", [])
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    manifests = {p.name for p in _yaml_files(RECIPE) if p.name != KUSTOMIZATION}
    assert set(listed) == manifests, \
        f"kustomization.yaml lists {sorted(listed)}; the manifests are {sorted(manifests)}"


PARAMS = "params.yaml"


def _gpu_fields(node, where: str = "") -> dict[str, object]:
    """Every field of `node` that counts GPUs (nvidia.com/gpu requests and limits, the
    nvidia.com/gpu.count node label), by where it is."""
    found: dict[str, object] = {}
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("nvidia.com/gpu", "nvidia.com/gpu.count") and not isinstance(value, dict):
                found[f"{where}.{key}"] = value
            else:
                found.update(_gpu_fields(value, f"{where}.{key}"))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found.update(_gpu_fields(item, f"{where}[{index}]"))
    return found


def test_the_gpu_count_cpus_and_memory_are_parameters(tmp_path):
    """params.yaml is the one place for the pod's shape: set there, every GPU count in the
    DaemonSet (requests, limits, the node label selected) and its CPUs and memory follow."""
    copy = tmp_path / "kubernetes"
    shutil.copytree(RECIPE, copy)
    params = yaml.safe_load((copy / PARAMS).read_text(encoding="utf-8"))
    params["data"].update(gpus="3", cpus="24", memory="96Gi")
    (copy / PARAMS).write_text(yaml.safe_dump(params), encoding="utf-8")
    rendered = _render(copy)
    workload = _only(("DaemonSet", "Deployment"), rendered)
    counts = _gpu_fields(workload)
    assert len(counts) == 3 and set(counts.values()) == {"3"}, counts
    container, _ = _launch_container(workload["spec"]["template"]["spec"])
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["cpu"] == "24"
        assert container["resources"][kind]["memory"] == "96Gi"
    assert "omni-dp-params" not in {d["metadata"]["name"] for _, _, d in rendered}


def test_daemonset_yaml_alone_holds_the_params_values():
    """`kubectl apply -f daemonset.yaml` (no kustomize) gets the same pod as the recipe."""
    raw = _only(("DaemonSet", "Deployment"), OBJECTS)
    assert raw == _only(("DaemonSet", "Deployment"))
    params = _named_in(OBJECTS, "ConfigMap", "omni-dp-params")["data"]
    assert set(_gpu_fields(raw).values()) == {params["gpus"]}


def test_the_render_is_kustomizes_own():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the render is checked against kustomize's "
                    "where it is")
    done = subprocess.run([kubectl, "kustomize", str(RECIPE)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    theirs = sorted(json.dumps(d, sort_keys=True) for d in yaml.safe_load_all(done.stdout))
    ours = sorted(json.dumps(d, sort_keys=True) for _, _, d in RENDERED)
    assert ours == theirs


# --- omni-dp's promises ------------------------------------------------------------------


def test_the_config_map_is_a_clean_omni_dp_config(tmp_path):
    recipe = _recipe()
    values, problems, deprecations = recipe.file_values(tmp_path)
    assert not problems, problems
    assert not deprecations, deprecations
    assert values, "the --config file sets nothing"
    # One place per setting: a flag would silently win over the file.
    in_file = {name for name, field in FIELDS.items() if values.get(field.name) is not None}
    both = sorted(set(recipe.flags) & in_file)
    assert not both, f"set both on the command line and in the ConfigMap: {both}"


def test_launch_runs_in_the_foreground_on_every_gpu(tmp_path):
    recipe = _recipe()
    argv = [*recipe.container.get("command", []), *recipe.container.get("args", [])]
    # The container's own process receives the kubelet's SIGTERM: a shell in front of omni-dp
    # would swallow it.
    assert PurePosixPath(argv[0]).name == "omni-dp", f"the command starts with {argv[0]!r}"
    assert recipe.flags.get("gpus") == "all", "the launch command must take --gpus all"
    assert int(recipe.flags["replicas_per_gpu"]) >= 1
    assert recipe.setting("detach", tmp_path) is False, \
        "with --detach the command returns and the container ends"
    assert recipe.setting("mps", tmp_path) is True


def test_launch_command_parses_with_omni_dp_itself(tmp_path):
    """The command and the ConfigMap, through `omni-dp launch`'s own parser and merge."""
    import click

    from omni_dp.cli.commands.launch import _options, launch
    from omni_dp.cli.common import take_deprecated

    recipe = _recipe()
    config = tmp_path / "launch.yaml"
    config.write_text(recipe.config_text, encoding="utf-8")
    args = list(recipe.args)
    args[args.index("--config") + 1] = str(config)
    try:
        ctx = launch.make_context("launch", args)
    except click.UsageError as exc:
        pytest.fail(f"`omni-dp launch` refuses the recipe's command: {exc.format_message()}")
    flags = {k: v for k, v in ctx.params.items() if k not in ("dry_run", "as_json",
                                                                "engine_args")}
    problems: list[str] = []
    notes = take_deprecated(ctx, flags)
    options = _options(ctx, flags, tuple(ctx.params["engine_args"]), problems, notes)
    assert not problems, problems
    assert not notes, notes
    assert options.detach is False


def test_grace_period_covers_the_whole_teardown(tmp_path):
    """SIGTERM drains: the kubelet must not SIGKILL the run while it tears itself down."""
    recipe = _recipe()
    grace = recipe.pod.get("terminationGracePeriodSeconds", 30)
    drain = float(recipe.setting("drain_timeout", tmp_path))
    pre_stop = recipe.container.get("lifecycle", {}).get("preStop")
    assert pre_stop is None or set(pre_stop) == {"sleep"}, \
        "a preStop hook other than `sleep` takes an unknown part of the grace period"
    sleep = pre_stop["sleep"]["seconds"] if pre_stop else 0
    assert grace > sleep + drain, f"terminationGracePeriodSeconds {grace} is no more than " \
        f"the preStop sleep ({sleep} s) and the drain timeout ({drain:g} s)"
    # The launcher's own bound on a teardown it runs (router, each replica stop wave, the
    # daemon), with and without --share-weights' two waves.
    bound = max(owner_bound(types.SimpleNamespace(
        replicas=[types.SimpleNamespace(index=i) for i in range(recipe.replicas)],
        plan=types.SimpleNamespace(share_weights=share)), drain) for share in (False, True))
    assert grace >= sleep + bound, f"terminationGracePeriodSeconds {grace} < preStop " \
        f"{sleep} s + the launcher's teardown bound {bound:g} s (drain_timeout {drain:g} s)"


def test_probes_ask_the_router(tmp_path):
    recipe = _recipe()
    router_port = int(recipe.setting("router_port", tmp_path))
    host = recipe.setting("host", tmp_path)
    assert host not in LOOPBACK, f"a router on {host} cannot be reached by probes or Services"
    expected = {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/live"}
    for probe, path in expected.items():
        assert probe in recipe.container, f"no {probe}"
        get = recipe.container[probe].get("httpGet")
        assert get is not None, f"{probe} must be an HTTP GET of the router"
        assert get["path"] == path, f"{probe} asks {get['path']}, not {path}"
        assert recipe.port(get["port"]) == router_port, \
            f"{probe} asks port {get['port']}, not the router's {router_port}"
        assert get.get("scheme", "HTTP") == "HTTP"
    # Model load happens before /ready can answer: the startup probe must wait longer than
    # omni-dp lets the replicas take (one start wave in parallel, or one per replica).
    startup = recipe.container["startupProbe"]
    budget = (startup.get("initialDelaySeconds", 0)
              + startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3))
    values, _, _ = recipe.file_values(tmp_path)
    assert values.get("start_timeout") is not None, \
        "set start_timeout in the ConfigMap: the startupProbe is sized from it"
    waves = recipe.replicas if recipe.setting("start", tmp_path) == "sequential" else (
        2 if recipe.setting("share_weights", tmp_path) else 1)
    needed = waves * float(values["start_timeout"])
    assert budget > needed, f"the startupProbe gives up after {budget} s; the replicas may " \
        f"take {needed:g} s"
    annotations = recipe.workload["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotations:
        assert int(annotations["prometheus.io/port"]) == router_port
        assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"


def _cpus(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_guaranteed_qos_with_whole_cores():
    """The static CPU manager policy gives exclusive CPUs only to a Guaranteed pod's
    containers with integer CPU requests; --cpu-blocks auto then cuts real cores."""
    recipe = _recipe()
    for container in [*recipe.pod.get("initContainers", []), *recipe.pod["containers"]]:
        resources = container.get("resources", {})
        requests, limits = resources.get("requests", {}), resources.get("limits", {})
        for resource in ("cpu", "memory"):
            assert resource in limits, f"{container['name']}: no {resource} limit"
            assert str(requests.get(resource, limits[resource])) == str(limits[resource]), \
                f"{container['name']}: {resource} requests != limits (not Guaranteed QoS)"
        assert _cpus(limits["cpu"]).is_integer(), \
            f"{container['name']}: cpu {limits['cpu']} is not a whole number of CPUs"
    cpus = int(_cpus(recipe.container["resources"]["limits"]["cpu"]))
    # Whole physical cores on a 2-way SMT node (full-pcpus-only allocates sibling pairs), at
    # least one core per replica.
    assert cpus % 2 == 0, f"{cpus} CPUs split a physical core"
    assert cpus >= 2 * recipe.replicas, \
        f"{cpus} CPUs are fewer than one 2-thread core for each of {recipe.replicas} replicas"
    gpu_requests = recipe.container["resources"].get("requests", {}).get("nvidia.com/gpu")
    assert gpu_requests in (None, recipe.container["resources"]["limits"]["nvidia.com/gpu"])
    count = recipe.pod.get("nodeSelector", {}).get("nvidia.com/gpu.count")
    assert count is None or int(count) == recipe.gpus, \
        f"the pod asks {recipe.gpus} GPUs of nodes that have {count}"


def test_state_dir_is_created_private_inside_a_writable_volume(tmp_path):
    recipe = _recipe()
    state = PurePosixPath(recipe.env("OMNI_DP_STATE_DIR"))
    assert state.is_absolute()
    mounts = [m for m in recipe.container.get("volumeMounts", [])
              if state.is_relative_to(m["mountPath"])]
    assert mounts, f"OMNI_DP_STATE_DIR {state} is on no volume (the root filesystem)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    assert not mount.get("readOnly"), f"the volume at {mount['mountPath']} is read-only"
    volume = next(v for v in recipe.pod["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume or "hostPath" in volume, volume
    # A volume's own directory is root's and mode 0777, which omni-dp refuses; a directory
    # that does not exist yet it creates 0700 and owned by the pod's user. Shown on a copy:
    inside = state.relative_to(mount["mountPath"])
    assert inside.parts, f"OMNI_DP_STATE_DIR is the mount point {mount['mountPath']} itself"
    volume_dir = tmp_path / "volume"
    volume_dir.mkdir()
    volume_dir.chmod(0o777)
    assert private_dir_problem(volume_dir) is not None
    made = volume_dir.joinpath(*inside.parts)
    make_private_dir(made)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert made.stat().st_uid == os.getuid()
    assert private_dir_problem(made) is None
    # Every daemon's control socket fits a Unix socket path, for the last GPU too.
    values, _, _ = recipe.file_values(tmp_path)
    run = run_dir(Path(str(state)), values.get("run_id") or new_run_id())
    assert socket_path_problems(str(mps_pipe_dir(run, recipe.gpus - 1))) == []


def test_pod_runs_unprivileged_and_reaps_its_orphans():
    recipe = _recipe()
    pod, container = recipe.pod, recipe.container
    for namespace in ("hostIPC", "hostPID", "hostNetwork"):
        assert not pod.get(namespace), f"{namespace}: omni-dp's MPS daemon is in the pod"
    # The pause process as PID 1 reaps what forks away from omni-dp (the MPS control daemon).
    assert pod.get("shareProcessNamespace") is True
    assert pod.get("automountServiceAccountToken") is False
    # A Service named omni-dp would otherwise put OMNI_DP_* variables in the environment.
    assert pod.get("enableServiceLinks") is False
    assert not [v["name"] for v in pod["volumes"] if "hostPath" in v]
    pod_security = pod.get("securityContext", {})
    security = {**pod_security, **container.get("securityContext", {})}
    assert security.get("runAsNonRoot") is True
    assert security.get("runAsUser", 0) != 0
    assert security.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost")
    assert security.get("allowPrivilegeEscalation") is False
    assert not security.get("privileged")
    assert security.get("capabilities", {}).get("drop") == ["ALL"]
    assert not security.get("capabilities", {}).get("add")
    assert security.get("readOnlyRootFilesystem") is True
    # With a read-only root, what omni-dp and its engines write goes to volumes.
    writable = [PurePosixPath(m["mountPath"]) for m in container.get("volumeMounts", [])
                if not m.get("readOnly")]
    for path in (PurePosixPath("/tmp"), PurePosixPath(recipe.env("HOME"))):
        assert any(path.is_relative_to(m) for m in writable), f"{path} is not writable"


def test_selectors_reach_the_pod_and_the_router(tmp_path):
    recipe = _recipe()
    labels = recipe.workload["spec"]["template"]["metadata"]["labels"]
    match = recipe.workload["spec"]["selector"]["matchLabels"]
    assert match.items() <= labels.items(), "the workload's selector misses its own pods"
    services = [d for p, _, d in RENDERED if p.parent == RECIPE and d["kind"] == "Service"]
    assert services
    router_port = int(recipe.setting("router_port", tmp_path))
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items(), \
            f"Service {service['metadata']['name']} selects no omni-dp pod"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert recipe.port(target) == router_port, \
                f"Service port {port['port']} goes to {target}, not the router's {router_port}"


# --- the image (deploy/Dockerfile) ---------------------------------------------------------

DOCKERFILE = DEPLOY / "Dockerfile"
# What scripts/setup reads to install omni-dp: the build context must carry them.
SETUP_NEEDS = ("pyproject.toml", "README.md", "omni_dp/__init__.py", "omni_dp/engine/audio.py",
               "scripts/setup", "scripts/torch_setup.py")
# What must stay out of the build context: local venvs (GBs), caches, weights, history.
CONTEXT_LEAVES_OUT = (".git/HEAD", ".venv/bin/python", ".venv-vllm/bin/python",
                      ".cache/mps/usr/bin/nvidia-cuda-mps-control", ".whl/x.whl", "weights/x",
                      "omni_dp/__pycache__/cli.cpython-311.pyc", "omni_dp.egg-info/PKG-INFO")
# Driver packages: the container toolkit mounts the node's own (Dockerfile's header says why).
DRIVER_PACKAGES = ("nvidia-cuda-mps", "nvidia-utils", "nvidia-compute-utils", "cuda-drivers",
                   "libnvidia-compute", "nvidia-driver")


@dataclasses.dataclass
class Image:
    commands: tuple

    def all(self, cmd: str) -> list:
        return [c for c in self.commands if c.cmd.upper() == cmd]

    def one(self, cmd: str):
        found = self.all(cmd)
        assert len(found) == 1, f"deploy/Dockerfile has {len(found)} {cmd} instructions, not 1"
        return found[0]

    def args(self, before_from: bool) -> dict[str, str]:
        first_from = self.commands.index(self.all("FROM")[0])
        chosen = self.commands[:first_from] if before_from else self.commands[first_from:]
        return dict(v.partition("=")[::2] for c in chosen if c.cmd.upper() == "ARG"
                    for v in c.value)

    @property
    def env(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for command in self.all("ENV"):
            found.update(zip(command.value[::2], command.value[1::2], strict=True))
        return found

    def runs(self) -> list[str]:
        return [" ".join(c.value) for c in self.all("RUN")]


def _image() -> Image:
    try:
        return Image(dockerfile.parse_file(str(DOCKERFILE)))
    except dockerfile.GoParseError as exc:
        pytest.fail(f"deploy/Dockerfile does not parse: {exc}")


def test_the_base_is_a_cuda_runtime_image_given_as_a_build_argument():
    image = _image()
    assert image.commands[0].cmd.upper() == "ARG", "the base's ARG must come before FROM"
    (base,) = image.one("FROM").value[:1]
    assert base.startswith("${") and base.endswith("}"), f"FROM {base}: not a build argument"
    default = image.args(before_from=True)[base[2:-1]]
    repository, _, tag = default.partition(":")
    # NVIDIA's CUDA images: the runtime flavour (base has no CUDA libraries, devel a compiler).
    assert repository == "nvidia/cuda", default
    assert "-runtime-" in tag, f"{default}: not a CUDA runtime image"
    assert tag and tag != "latest", "a pinned tag (hadolint DL3007)"


def test_omni_dp_is_installed_from_the_repository_by_its_own_setup():
    image = _image()
    copies = image.all("COPY")
    assert any(c.value[:-1] == (".",) for c in copies), "the repository is not copied in"
    setup = [r for r in image.runs() if "scripts/setup" in r]
    assert len(setup) == 1, "scripts/setup must install omni-dp (one RUN)"
    assert "OMNI_DP_TORCH=cuda" in setup[0], "no driver at build time: the CUDA build is asked"
    # The image's torch is the one scripts/setup would pick, and setup installs the aac extra.
    script = (ROOT / "scripts" / "setup").read_text()
    assert f"OMNI_DP_TORCH_VERSION:-{image.args(before_from=False)['TORCH_VERSION']}}}" \
        in script, "TORCH_VERSION differs from scripts/setup's default"
    assert 'EXTRAS="fast,aac"' in script
    venv = setup[0].split("OMNI_DP_VENV=")[1].split()[0]
    assert image.env["PATH"].startswith(f"{venv}/bin:"), "omni-dp is not on PATH"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` out: a pattern matching it or a folder above it
    (Docker's matching, for the patterns used: `*`, `**/`, no `!`)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        candidates = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            return True
    return False


def test_the_build_context_carries_what_setup_needs_and_no_venv():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "negations: the check cannot read them"
    carried = [p for p in CONTEXT_LEAVES_OUT if not _ignored(p, patterns)]
    assert not carried, f"the build context would carry {carried}"
    missing = [p for p in SETUP_NEEDS if _ignored(p, patterns) or not (ROOT / p).exists()]
    assert not missing, f"scripts/setup needs {missing}, kept out of the build context"


def test_numactl_and_python_in_the_image_and_no_driver_programs():
    image = _image()
    installs = [r for r in image.runs() if "apt-get install" in r]
    assert len(installs) == 1, installs
    packages = set(installs[0].split("apt-get install", 1)[1].split("&&")[0].split())
    assert {"numactl", "python3", "python3-venv"} <= packages, packages
    driver = [p for p in packages if p.startswith(DRIVER_PACKAGES)]
    assert not driver, f"driver programs {driver} in the image: the toolkit mounts the node's"
    # The toolkit mounts nvidia-cuda-mps-control and -server for `compute`, nvidia-smi for
    # `utility`: the image asks both, as the DaemonSet does.
    capabilities = set(image.env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    assert {"compute", "utility"} <= capabilities
    assert capabilities == set(_recipe().env("NVIDIA_DRIVER_CAPABILITIES").split(","))
    # hadolint DL3015 and DL3009: no recommended packages, no apt lists left in the layer.
    assert "--no-install-recommends" in installs[0] and "rm -rf /var/lib/apt/lists" in installs[0]


def test_the_image_runs_as_the_pods_user_with_omni_dp_as_its_entrypoint(tmp_path):
    image = _image()
    recipe = _recipe()
    security = {**recipe.pod.get("securityContext", {}),
                **recipe.container.get("securityContext", {})}
    user = image.all("USER")[-1].value[0]
    assert user == f"{security['runAsUser']}:{security['runAsGroup']}", \
        f"USER {user} is not the pod's runAsUser:runAsGroup"  # and not root (hadolint DL3002)
    # Exec form (hadolint DL3025): omni-dp itself gets the SIGTERM, no shell in front.
    entrypoint = image.one("ENTRYPOINT")
    assert entrypoint.json and list(entrypoint.value) == ["omni-dp"]
    assert image.one("CMD").json
    assert PurePosixPath(recipe.container["command"][0]).name == entrypoint.value[0]
    assert image.one("EXPOSE").value == (str(recipe.setting("router_port", tmp_path)),)
    assert all(PurePosixPath(w.value[0]).is_absolute() for w in image.all("WORKDIR"))  # DL3000
