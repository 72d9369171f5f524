"""The weight-share manifest: its format, typed, its one writer and its one reader.

A sharing leader publishes, in its share directory (a run's `share/`, mode 0700):

    weights.json   the manifest (this module), mode 0600, written atomically
    weights.bin    on CPU: the segment every tensor of the manifest lives in (file-backed
                   shared memory, mapped read-only by everyone, the leader too)

A follower (omni_dp/engine/share/) and the launcher (to record what is shared) read the
manifest with `read_manifest`, which checks the file before a byte of it is parsed (regular
file, opened without following links, ours, no group/world bits, bounded size) and every field
after: a manifest is input, and a wrong one is a `ShareFileError` naming what is wrong. Nothing
in it is ever unpickled: CUDA IPC handles travel as hex strings of the bytes torch's own
`_share_cuda_()` returns.

Torch-free, so that the launcher can read it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from omni_dp.files import atomic_write
from omni_dp.procs import ProcessIdentity
from omni_dp.records import Hex, Malformed, Record, Shape

FORMAT = 1
MANIFEST_FILE = "weights.json"
SEGMENT_FILE = "weights.bin"
MAX_MANIFEST_BYTES = 8 * 1024**2  # thousands of tensors fit in far less; more is not ours
ALIGN = 64  # every tensor starts on a cache line of its buffer
BUFFER_KINDS = ("segment", "cuda_ipc")
ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}
DTYPES = tuple(ITEMSIZE)  # the dtypes a manifest may name, by torch's names
MAX_DIMS = 8
# A cudaIpcMemHandle_t or cudaIpcEventHandle_t is 64 bytes; torch's handle bytes are that, or
# a little more: anything near a kilobyte is not one.
MAX_IPC_HANDLE_BYTES = 1024


class ShareFileError(Exception):
    """A manifest or segment that cannot be used, with the reason; a follower fails closed."""


@dataclass(frozen=True)
class ModelIdentity(Record):
    source: str  # "preset tiny, seed 0", or the weights directory
    digest: str  # sha256 (hex) of the config and the seed, or of the directory's files


_HANDLES = (("handle", False), ("ref_counter_handle", False),
            ("event_handle", True))  # empty when the leader's stream needs no waiting on


@dataclass(frozen=True)
class CudaIpcHandle(Record):
    """What torch's `UntypedStorage._share_cuda_()` returns for one storage, as JSON can hold
    it (bytes as hex); `UntypedStorage._new_shared_cuda(*handle.args())` opens it."""

    device: int  # in the leader's numbering; the manifest's `device` names the GPU by UUID
    handle: Hex
    storage_size: int
    storage_offset: int
    ref_counter_handle: Hex
    ref_counter_offset: int
    event_handle: Hex
    event_sync_required: bool

    def __post_init__(self) -> None:
        """The checks a follower makes before it opens a handle (the leader's are the same)."""
        for key in ("device", "storage_size", "storage_offset", "ref_counter_offset"):
            if getattr(self, key) < 0:
                raise ValueError(f".{key} is negative")
        for key, may_be_empty in _HANDLES:
            value = getattr(self, key)
            object.__setattr__(self, key, Hex(value))  # torch's bytes, written as hex
            if not value and not may_be_empty:
                raise ValueError(f".{key} is empty")
            if len(value) > MAX_IPC_HANDLE_BYTES:
                raise ValueError(f".{key} is {len(value)} bytes, more than "
                                 f"{MAX_IPC_HANDLE_BYTES}")

    def args(self) -> tuple:
        return (self.device, bytes(self.handle), self.storage_size, self.storage_offset,
                bytes(self.ref_counter_handle), self.ref_counter_offset,
                bytes(self.event_handle), self.event_sync_required)


@dataclass(frozen=True)
class Buffer(Record):
    """One flat buffer the tensors are views of: the CPU segment file, or one CUDA storage."""

    JSON_SHAPE = Shape(omit_none=("file", "sha256", "ipc"))  # a segment's keys, or the handle

    kind: str  # segment | cuda_ipc
    nbytes: int
    file: str | None = None  # segment: its name in the share directory
    sha256: str | None = None  # segment: of its bytes, as the leader wrote them
    ipc: CudaIpcHandle | None = None  # cuda_ipc

    def __post_init__(self) -> None:
        if self.kind not in BUFFER_KINDS:
            raise ValueError(f".kind is {self.kind!r}, not one of {', '.join(BUFFER_KINDS)}")
        if self.nbytes < 0:
            raise ValueError(".nbytes is negative")
        if self.kind == "cuda_ipc":
            if self.ipc is None:
                raise ValueError(".ipc is null, not an object")
            return
        if self.file != SEGMENT_FILE:  # never a path: the segment lives beside the manifest
            raise ValueError(f".file is {self.file!r}, not {SEGMENT_FILE!r}")
        digest = self.sha256 or ""
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise ValueError(".sha256 is not a sha256 hex digest")


@dataclass(frozen=True)
class TensorEntry(Record):
    """One tensor: a view of `nbytes` at `offset` of buffer `buffer`."""

    name: str  # as in the model's state dict, prefixed by its network: "talker.norm.weight"
    dtype: str  # torch's name: float64, bfloat16, ...
    shape: tuple[int, ...]
    buffer: int
    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f".dtype is {self.dtype!r}, not one of {', '.join(DTYPES)}")
        if len(self.shape) > MAX_DIMS or not all(d >= 0 for d in self.shape):
            raise ValueError(f".shape is not a list of at most {MAX_DIMS} non-negative "
                             "integers")
        if self.nbytes != math.prod(self.shape) * ITEMSIZE[self.dtype]:
            raise ValueError(f"nbytes {self.nbytes} is not {self.shape} × "
                             f"{ITEMSIZE[self.dtype]} bytes")
        if self.offset < 0 or self.offset % ALIGN:
            raise ValueError(f".offset {self.offset} is not a non-negative multiple of {ALIGN}")


def _read_format(data: dict) -> dict:
    """A manifest of another format is refused by its number, before any other key is read."""
    version = data.get("format", "absent")
    if version == "absent":
        raise Malformed("the top level has no 'format'")
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT:
        raise Malformed(f"format is {version}; this omni-dp reads format {FORMAT}")
    return data


@dataclass(frozen=True)
class ShareManifest(Record):
    JSON_SHAPE = Shape(read=_read_format,
                       write=lambda data: {"format": data.pop("format"), **data})

    architecture: str  # the model's (config.ARCHITECTURE); its share policy decides the sets
    policy: str  # the policy's name and version, e.g. "omni-dp-tts/1"
    model: ModelIdentity
    dtype: str  # the talker's dtype (the vocoder's is float32)
    device: str  # "cpu", or the GPU as "GPU-<uuid>"
    run_id: str
    leader: ProcessIdentity
    buffers: tuple[Buffer, ...]
    shared: tuple[TensorEntry, ...]  # mapped by every follower: one copy on the device
    private: tuple[TensorEntry, ...]  # copied by every follower into memory of its own
    created_at: float
    format: int = FORMAT

    def __post_init__(self) -> None:
        if not math.isfinite(self.created_at):  # json reads NaN, Infinity
            raise ValueError(f".created_at is {self.created_at}, not a finite number")
        self.check_layout()

    @property
    def shared_bytes(self) -> int:
        return sum(t.nbytes for t in self.shared)

    @property
    def private_bytes(self) -> int:
        return sum(t.nbytes for t in self.private)

    def check_layout(self) -> None:
        """Names unique; every tensor inside its buffer; no two tensors overlapping."""
        names = [t.name for t in (*self.shared, *self.private)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise Malformed(f"tensor(s) named twice: {', '.join(dupes[:5])}")
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for t in (*self.shared, *self.private):
            if not 0 <= t.buffer < len(self.buffers):
                raise Malformed(f"tensor {t.name}: buffer {t.buffer} does not exist "
                                f"({len(self.buffers)} buffer(s))")
            if t.offset + t.nbytes > self.buffers[t.buffer].nbytes:
                raise Malformed(f"tensor {t.name}: bytes {t.offset}..{t.offset + t.nbytes} lie "
                                f"past the end of buffer {t.buffer} "
                                f"({self.buffers[t.buffer].nbytes} bytes)")
            spans.setdefault(t.buffer, []).append((t.offset, t.offset + t.nbytes, t.name))
        for items in spans.values():
            items.sort()
            for (_, end, a), (start, _, b) in itertools.pairwise(items):
                if start < end:
                    raise Malformed(f"tensors {a} and {b} overlap")


# --- the files ------------------------------------------------------------------------------


def manifest_path(directory: Path) -> Path:
    return directory / MANIFEST_FILE


def segment_path(directory: Path) -> Path:
    return directory / SEGMENT_FILE


def write_manifest(directory: Path, manifest: ShareManifest) -> Path:
    """Publish: written whole to a temp file, fsynced, renamed (a reader never sees half)."""
    path = manifest_path(directory)
    atomic_write(path, json.dumps(manifest.to_json(), indent=1) + "\n", mode=0o600)
    return path


def open_private_file(path: Path, what: str) -> int:
    """An fd of `path` opened read-only without following a link, checked to be a regular
    file of ours that no group or other user may write or read; ShareFileError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ShareFileError(f"the {what} {path} does not exist") from None
    except OSError as exc:  # ELOOP: a symlink
        raise ShareFileError(f"cannot open the {what} {path}: {exc.strerror}"
                             + (" (it is a symlink)" if os.path.islink(path) else "")) from None
    try:
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
        elif info.st_mode & 0o077:
            problem = (f"has mode {stat.S_IMODE(info.st_mode):o}; group or other users may "
                       "reach it (it must be 0600)")
        if problem:
            raise ShareFileError(f"the {what} {path} {problem}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_manifest(directory: Path) -> ShareManifest:
    """The share directory's manifest, its file and every field checked."""
    path = manifest_path(directory)
    fd = open_private_file(path, "weight-share manifest")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ShareFileError(f"the weight-share manifest {path} is larger than "
                             f"{MAX_MANIFEST_BYTES} bytes")
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ShareFileError(f"the weight-share manifest {path} is not JSON ({exc})") from None
    except RecursionError:  # nested deeper than the parser's stack: not a manifest either
        raise ShareFileError(f"the weight-share manifest {path} is not a manifest: nested "
                             "too deeply to parse") from None
    try:
        return ShareManifest.from_json(data)
    except Malformed as exc:
        raise ShareFileError(f"the weight-share manifest {path} is malformed: {exc}") from None
