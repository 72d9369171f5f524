"""Where the MPS programs are: the control daemon, the server it starts, and their versions.

The control daemon starts `nvidia-cuda-mps-server` by looking it up on its OWN PATH (measured
with Debian's 535 build), so the server is located here too, and MpsControl.env puts its folder
first on the daemon's PATH. Distributions split the pair (Debian: control in /usr/bin, server in
/usr/sbin, rarely on a user's PATH); a driver install keeps both in one folder, which on the GPU
machines we are lent is a read-only mount that PATH may not name.

Nothing here starts the daemon; the control binary is only read, never run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from omni_dp.gpus import nvml_driver_version
from omni_dp.mps.control import BINARY_ENV, BINARY_NAME, BinaryNotFound

SERVER_NAME = "nvidia-cuda-mps-server"
SMI_NAME = "nvidia-smi"
# Searched after PATH. /usr/local/nvidia/bin: where GKE-style setups (and the GPU machines we are
# lent) mount the driver's programs into a container, read-only and often not on PATH. /usr/bin:
# where the driver's .run installer and distribution packages put them, for a trimmed PATH
# (service units, env -i).
DRIVER_DIRS = ("/usr/local/nvidia/bin", "/usr/bin")
PROC_VERSION = "/proc/driver/nvidia/version"

# --mps-control's help (launch and `mps start`): where the binary is looked for, in order.
CONTROL_HELP = (
    f"The {BINARY_NAME} binary (its {SERVER_NAME} is found beside it). [default: "
    f"${BINARY_ENV}, then PATH, {', '.join(DRIVER_DIRS)}, next to {SMI_NAME}]")

INSTALL_HINT = (
    f"{BINARY_NAME} ships with the NVIDIA driver (next to nvidia-smi; in containers often "
    "/usr/local/nvidia/bin); on Debian install the package nvidia-cuda-mps from the non-free "
    "component (apt-get install nvidia-cuda-mps once non-free is enabled); "
    f"or point omni-dp at it with --mps-control PATH or {BINARY_ENV}=PATH"
)

# The control binary has no version flag: -h/--help print a banner without one, and any other
# argument (-v, --version, -V) makes it a front end that asks a running daemon. Its bytes do hold
# the driver release it was built from (Debian's 535 build: exactly one "535.309.01"), so that is
# read instead. Driver releases are 3 digits, a dot, 2-3 digits, optionally a dot and 2-3 digits
# (470.82.01, 535.309.01, 580.159.03); the "100.0" of its percentage messages is not one.
_VERSION = re.compile(rb"(?<![\d.])(\d{3}\.\d{2,3}(?:\.\d{2,3})?)(?![\d.])")
_MAX_SCAN_BYTES = 64 * 1024**2
_PROC_VERSION_LINE = re.compile(r"Kernel Module\b.*?\s(\d{3}\.\d+(?:\.\d+)?)\s")


@dataclass(frozen=True)
class MpsBinaries:
    """The control/server pair a run uses, how control was found, and the versions involved."""

    control: str  # absolute path
    server: str | None  # absolute path; None: none found, the daemon searches its own PATH
    origin: str  # "--mps-control", "$OMNI_DP_MPS_CONTROL", "PATH", "driver folder …", …
    control_version: str | None  # the driver release the control binary was built from
    driver_version: str | None  # the loaded driver's release

    def describe(self) -> str:
        """One line: the pair used, where control was found, the versions."""
        server = (f"server {self.server}" if self.server else
                  f"no {SERVER_NAME} found (the daemon looks on its own PATH)")
        return (f"MPS control {self.control} (from {self.origin}, version "
                f"{self.control_version or 'unknown'}), {server}; driver "
                f"{self.driver_version or 'unknown'}")

    @property
    def mismatch(self) -> bool:
        """Both versions known and different. The exact release is compared, not the major:
        control, server and driver are released together and NVIDIA states no compatibility
        between releases (the driver's own libraries refuse a kernel module of another version
        down to the last digit), and the matching binary is always installed with the driver."""
        return (self.control_version is not None and self.driver_version is not None
                and self.control_version != self.driver_version)


def describe_unusable(path: str) -> str | None:
    """Why `path` cannot be run, or None when it can."""
    if not os.path.lexists(path):
        return f"{path} does not exist"
    if not os.path.exists(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"{path} is a broken symbolic link (to {target})"
    if os.path.isdir(path):
        return f"{path} is a directory, not the {BINARY_NAME} program"
    if not os.path.isfile(path):
        return f"{path} is not a regular file"
    if not os.access(path, os.X_OK):
        return f"{path} is not executable (chmod +x {path}, or fix its permissions)"
    return None


def control_version(path: str) -> str | None:
    """The driver release `path` was built from; None when unreadable, or none or several
    version-like strings are in it."""
    try:
        with open(path, "rb") as binary:
            data = binary.read(_MAX_SCAN_BYTES)
    except OSError:
        return None
    found = {match.decode() for match in _VERSION.findall(data)}
    return found.pop() if len(found) == 1 else None


def driver_version() -> str | None:
    """The loaded driver's release: NVML's word, else the kernel module's (/proc); None where
    there is no driver. For a launch that asked NVML already, the version it read with the GPU
    is used instead (omni_dp.mps.preflight.check_preflight)."""
    return nvml_driver_version() or kernel_driver_version()


def kernel_driver_version() -> str | None:
    """The release of the loaded kernel module, from /proc; None where it is not loaded."""
    try:
        with open(PROC_VERSION) as proc:
            match = _PROC_VERSION_LINE.search(proc.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))


def _path_dirs(environ: Mapping[str, str]) -> list[str]:
    return _unique(d for d in environ.get("PATH", "").split(os.pathsep) if d)


def _smi_dirs(folders: Sequence[str]) -> list[str]:
    """The folders of nvidia-smi found in `folders`, and of what it links to (Debian's
    /usr/bin/nvidia-smi is an alternatives link into /usr/lib/nvidia/current)."""
    dirs = []
    for folder in folders:
        smi = os.path.join(folder, SMI_NAME)
        if describe_unusable(smi) is None:
            dirs += [folder, os.path.dirname(os.path.realpath(smi))]
    return _unique(dirs)


def _places(environ: Mapping[str, str], driver_dirs: Sequence[str]) -> list[tuple[str, str]]:
    """(origin, folder) in search order: PATH, the driver folders, next to nvidia-smi."""
    path = _path_dirs(environ)
    places = [("PATH", d) for d in path]
    places += [(f"driver folder {d}", d) for d in driver_dirs]
    places += [(f"next to {SMI_NAME} ({d})", d) for d in _smi_dirs([*path, *driver_dirs])]
    seen: set[str] = set()
    unique = []
    for origin, folder in places:
        if folder not in seen:
            seen.add(folder)
            unique.append((origin, folder))
    return unique


def _first_usable(name: str, places: list[tuple[str, str]]) -> tuple[str | None, str, list[str]]:
    """(path, its origin, why the candidates passed over are unusable)."""
    unusable = []
    for origin, folder in places:
        candidate = os.path.join(folder, name)
        reason = describe_unusable(candidate)
        if reason is None:
            return os.path.abspath(candidate), origin, unusable
        if os.path.lexists(candidate):
            unusable.append(reason)
    return None, "", unusable


def _find_control(explicit: str | None, environ: Mapping[str, str],
                  driver_dirs: Sequence[str]) -> tuple[str, str]:
    """(control path, origin) or BinaryNotFound saying everywhere it looked and what to do."""
    if explicit:
        given, label, origin = explicit, "--mps-control", "--mps-control"
    elif environ.get(BINARY_ENV):
        given, label, origin = environ[BINARY_ENV], BINARY_ENV, f"${BINARY_ENV}"
    else:
        return _search_control(environ, driver_dirs)
    if os.sep in given:
        reason = describe_unusable(given)
        if reason is not None:
            raise BinaryNotFound(f"{label}={given}: {reason}; {INSTALL_HINT}")
        return os.path.abspath(given), origin
    path = _path_dirs(environ)  # a bare name: looked up on PATH, as a shell would
    found, _, unusable = _first_usable(given, [("PATH", d) for d in path])
    if found:
        return found, f"{origin} on PATH"
    raise BinaryNotFound(f"{label}={given}: no executable named {given!r} on PATH "
                         f"{_searched(path)}{_passed_over(unusable)}; {INSTALL_HINT}")


def _search_control(environ: Mapping[str, str], driver_dirs: Sequence[str]) -> tuple[str, str]:
    found, origin, unusable = _first_usable(BINARY_NAME, _places(environ, driver_dirs))
    if found:
        return found, origin
    path = _path_dirs(environ)
    smi = _smi_dirs([*path, *driver_dirs])
    raise BinaryNotFound(
        f"{BINARY_NAME} not found on PATH {_searched(path)}, nor in the driver folders "
        f"({', '.join(driver_dirs) or 'none'}), nor next to {SMI_NAME} "
        f"({', '.join(smi) if smi else 'not found either'}){_passed_over(unusable)}; "
        f"{INSTALL_HINT}")


def _searched(path: list[str]) -> str:
    return f"(searched {', '.join(path)})" if path else "(PATH is empty)"


def _passed_over(unusable: list[str]) -> str:
    return f"; found but unusable: {'; '.join(unusable)}" if unusable else ""


def _find_server(control: str, environ: Mapping[str, str],
                 driver_dirs: Sequence[str]) -> str | None:
    """Next to the control binary (or what it links to), in ../sbin (Debian), then as control."""
    near = []
    for folder in _unique([os.path.dirname(control), os.path.dirname(os.path.realpath(control))]):
        near += [("", folder), ("", os.path.normpath(os.path.join(folder, os.pardir, "sbin")))]
    found, _, _ = _first_usable(SERVER_NAME, [*near, *_places(environ, driver_dirs)])
    return found


def locate_mps_binaries(
    explicit: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    driver_dirs: Sequence[str] | None = None,
    driver: Callable[[], str | None] | None = None,
) -> MpsBinaries:
    """The control binary: `explicit` (--mps-control), else $OMNI_DP_MPS_CONTROL, else PATH,
    the driver folders, next to nvidia-smi; and its server. Raises BinaryNotFound.

    `environ`, `driver_dirs` (default DRIVER_DIRS) and `driver` (default driver_version) are
    read at call time, so tests can give fake ones.
    """
    environ = os.environ if environ is None else environ
    driver_dirs = DRIVER_DIRS if driver_dirs is None else driver_dirs
    control, origin = _find_control(explicit, environ, driver_dirs)
    return MpsBinaries(
        control=control,
        server=_find_server(control, environ, driver_dirs),
        origin=origin,
        control_version=control_version(control),
        driver_version=(driver or driver_version)(),
    )


def mismatch_message(binaries: MpsBinaries, *, environ: Mapping[str, str] | None = None,
                     driver_dirs: Sequence[str] | None = None) -> str:
    """What to say when the control binary is of another release than the driver; names a
    matching one where the search finds it."""
    environ = os.environ if environ is None else environ
    driver_dirs = DRIVER_DIRS if driver_dirs is None else driver_dirs
    own = next((path for _, folder in _places(environ, driver_dirs)
                if describe_unusable(path := os.path.join(folder, BINARY_NAME)) is None
                and control_version(path) == binaries.driver_version), None)
    where = (f"{own} is that one" if own else
             f"it is installed with the driver, next to {SMI_NAME}")
    return (f"control binary {binaries.control} (from {binaries.origin}) is version "
            f"{binaries.control_version} but the driver is {binaries.driver_version}; use the "
            f"driver's own {BINARY_NAME} ({where}): --mps-control PATH or {BINARY_ENV}=PATH")
