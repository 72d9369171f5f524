"""State files and directories: written so that a reader never sees half of one, kept where
only their owner can reach them (shared by mps and launcher)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class PrivateDirError(OSError):
    """A directory that must be private to this user is not; the message says how."""


def private_dir_problem(path: Path) -> str | None:
    """Why an existing directory cannot be a private (0700, ours, real) directory of the run:
    the state root, the MPS pipe and log dirs, the weight-share directory. None if it can, or
    does not exist yet."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symlink; it must be a real, private directory"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} exists and is not a directory"
    if info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    if info.st_mode & 0o077:
        return (f"{path} has mode {stat.S_IMODE(info.st_mode):o}; it must not be group- or "
                "world-accessible (0700)")
    return None


def make_private_dir(path: Path) -> None:
    """Create `path` (and its parents) 0700 whatever the umask, or raise PrivateDirError when
    it exists and is not private; an existing private one is kept as it is."""
    problem = private_dir_problem(path)
    if problem:
        raise PrivateDirError(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask


def atomic_write(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a sibling temp file, fsync it, then rename it over `path` (atomic on POSIX)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
