"""The CPU segment: one file of the share directory holding every tensor of the manifest,
written once by the leader and mapped read-only (PROT_READ, MAP_SHARED) by everyone.

A file mapping rather than POSIX shm or a memfd: it lives in the run's private directory (0700)
beside the manifest, is found by name, and goes with the directory. Its pages sit once in the
page cache, however many processes map them; a write through a read-only mapping is a SIGSEGV,
so no replica can change another's weights. Mappings are kept for the life of the process:
parameters are views of them.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from omni_dp.engine.share import ShareError
from omni_dp.sharefile import ShareFileError, TensorEntry, open_private_file, segment_path

_MAPPINGS: list[mmap.mmap] = []  # every mapping this process made: never unmapped


class Mapping:
    """One read-only mapping of a segment, as a flat uint8 tensor."""

    def __init__(self, mm: mmap.mmap) -> None:
        _MAPPINGS.append(mm)
        with warnings.catch_warnings():
            # "The given buffer is not writable": it is meant not to be; a write faults.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.flat = torch.frombuffer(mm, dtype=torch.uint8)
        self._mm = mm

    def sha256(self) -> str:
        """Of the mapped bytes: pages already in the page cache are read, none copied."""
        return hashlib.sha256(self._mm).hexdigest()


def remove_ours(path: Path, what: str) -> None:
    """Unlink a leftover of an earlier leader: only a regular file of ours, never through a
    link; ShareError if something else is in the way."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        raise ShareError(f"{path} exists and is not a {what} of ours (a regular file of uid "
                         f"{os.geteuid()}); remove it")
    os.unlink(path)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


def write_segment(directory: Path, nbytes: int,
                  placed: Iterable[tuple[TensorEntry, torch.Tensor]]) -> Path:
    """Create the segment (never reusing a file: O_EXCL, no link followed), write every tensor
    at its offset, fsync, and drop the write bit (0400: not even we reopen it for writing)."""
    path = segment_path(directory)
    remove_ours(path, "weight-share segment")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise ShareError(f"cannot create the weight-share segment {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        position = 0
        for entry, tensor in sorted(placed, key=lambda item: item[0].offset):
            f.write(bytes(entry.offset - position))
            f.write(_tensor_bytes(tensor))
            position = entry.offset + entry.nbytes
        f.write(bytes(nbytes - position))
        f.flush()
        os.fsync(f.fileno())
        os.fchmod(f.fileno(), 0o400)
    return path


def map_segment(directory: Path, nbytes: int) -> Mapping:
    """The segment mapped read-only, after the file checks of sharefile (regular, ours, no
    group/other bits, not a link) and its size checked against the manifest's."""
    path = segment_path(directory)
    try:
        fd = open_private_file(path, "weight-share segment")
    except ShareFileError as exc:
        raise ShareError(str(exc)) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ShareError(f"the weight-share segment {path} is truncated: {size} bytes, the "
                             f"manifest says {nbytes}")
        if size > nbytes:
            raise ShareError(f"the weight-share segment {path} is {size} bytes, the manifest "
                             f"says {nbytes}")
        if nbytes == 0:
            raise ShareError(f"the weight-share segment {path} is empty")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file
    return Mapping(mm)
