"""Checksums of what the writers write, and their verification: one module for every kind of file.

Shards, the teacher cache and checkpoints are hashed while they are written (`HashingSink`:
nothing is read back) and listed in their directory's completion marker, written last, under the
same ``hash`` and ``checksums`` keys, so one verifier reads them all. xxh3_64 is only asked to
detect damage, not tampering (marker layout, the choice of hash: docs/integrity.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tokenbridge import atomic

HASH = "xxh3_64"  # what every writer records now
HASHES = {
    "xxh3_64": xxhash.xxh3_64,
    "blake2b": lambda: hashlib.blake2b(digest_size=16),  # shard markers of version 2
}
VERIFY_MODES = ("first_open", "preflight", "never")
_BLOCK = 8 << 20  # read size when verifying: large enough that the hash, not Python, dominates


class IntegrityError(ValueError):
    """A file on disk is not what its writer wrote, or holds values a model must not see."""


class DamagedFileError(IntegrityError):
    """A file whose size or checksum differs from its completion marker (or that is missing)."""

    def __init__(self, path: str | os.PathLike, *, expected: str, found: str, hint: str = ""):
        self.path, self.expected, self.found = Path(path), expected, found
        msg = f"{path}: damaged: expected {expected}, found {found}"
        super().__init__(msg + (f"; {hint}" if hint else ""))


def check_verify_mode(verify: str) -> None:
    """``verify`` of a reader (shards, teacher cache) must be one of `VERIFY_MODES`."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected one of {VERIFY_MODES}")


def new_hash(algo: str = HASH):
    try:
        return HASHES[algo]()
    except KeyError:
        raise IntegrityError(
            f"unknown checksum algorithm {algo!r} (known: {sorted(HASHES)})"
        ) from None


def entry(size: int, digest: str, algo: str = HASH) -> dict:
    """One file's marker entry."""
    return {"bytes": int(size), algo: digest}


def manifest_entry(info: dict) -> dict:
    """A rolling part's manifest (rows, bytes, checksum, ...) -> its marker entry."""
    algo = entry_algo(info)
    return entry(info["bytes"], info[algo], algo)


def entry_algo(e: dict) -> str:
    """The algorithm an entry was written with (its one key besides ``bytes``)."""
    algos = [k for k in e if k in HASHES]
    if len(algos) != 1:
        raise IntegrityError(f"checksum entry {e} names no single known algorithm")
    return algos[0]


def describe(e: dict) -> str:
    algo = entry_algo(e)
    return f"{algo} {e[algo]} over {e['bytes']} bytes"


@dataclass
class Cost:
    """What integrity costs this process: bytes and seconds hashed by writers (the hash update
    alone, not the write), by verification (the read + hash), and the value checks of the
    record batches a reader handed on (`tokenbridge.formats.value_checks`). A run's summary reports it."""

    write_bytes: int = 0
    write_seconds: float = 0.0
    bytes: int = 0
    seconds: float = 0.0
    checked_rows: int = 0
    check_seconds: float = 0.0

    def to_json(self) -> dict:
        return {
            "hash_at_write_s": round(self.write_seconds, 4),
            "hashed_at_write_bytes": self.write_bytes,
            "verify_s": round(self.seconds, 4),
            "verified_bytes": self.bytes,
            "value_check_s": round(self.check_seconds, 4),
            "value_checked_rows": self.checked_rows,
        }


COST = Cost()


class HashingSink:
    """A binary file that hashes what goes through it (pyarrow, torch.save and pickle write to
    any such object). `close` flushes and fsyncs; `entry()` is then the file's marker entry.

    `stream`: write into this open binary stream instead of opening `path` (an object-store
    upload, which has nothing to fsync: its object appears whole when the stream closes)."""

    def __init__(self, path: str | os.PathLike, *, algo: str = HASH, stream=None):
        self.path, self.algo = (Path(path) if stream is None else path), algo
        self.file = open(self.path, "wb") if stream is None else stream  # noqa: SIM115
        self.hash = new_hash(algo)
        self.size = 0
        self.closed = False

    def write(self, data) -> int:
        view = memoryview(data)
        t0 = time.perf_counter()
        self.hash.update(view)
        COST.write_seconds += time.perf_counter() - t0
        COST.write_bytes += view.nbytes
        self.size += view.nbytes
        return self.file.write(view)

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.file.fileno()

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.file.flush()
            try:  # a local file; an upload stream has no descriptor (and nothing to sync)
                fd = self.file.fileno()
            except (OSError, ValueError, AttributeError):
                fd = None
            if fd is not None:
                os.fsync(fd)
            self.file.close()

    def digest(self) -> str:
        return self.hash.hexdigest()

    def entry(self) -> dict:
        return entry(self.size, self.digest(), self.algo)


def hash_file(path: str | os.PathLike, algo: str = HASH) -> dict:
    """The marker entry of the file as it is on disk now (one sequential read)."""
    h, size = new_hash(algo), 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    COST.bytes += size
    COST.seconds += time.perf_counter() - t0
    return entry(size, h.hexdigest(), algo)


def verify_file(path: str | os.PathLike, expected: dict, *, hint: str = "") -> None:
    """Raise `DamagedFileError` unless the file's size and checksum are the `expected` entry."""
    p = Path(path)
    if not p.is_file():
        raise DamagedFileError(p, expected=describe(expected), found="no such file", hint=hint)
    algo = entry_algo(expected)
    found = hash_file(p, algo)
    if found["bytes"] != int(expected["bytes"]) or found[algo] != expected[algo]:
        raise DamagedFileError(p, expected=describe(expected), found=describe(found), hint=hint)


def check_bytes(data: bytes, expected: dict, *, where: str, hint: str = "") -> None:
    """`verify_file` for bytes already in memory (an object read whole), named `where`."""
    algo = entry_algo(expected)
    h = new_hash(algo)
    h.update(data)
    found = entry(len(data), h.hexdigest(), algo)
    if found["bytes"] != int(expected["bytes"]) or found[algo] != expected[algo]:
        raise DamagedFileError(where, expected=describe(expected), found=describe(found), hint=hint)


_verified: set[tuple] = set()
_verified_lock = threading.Lock()


def verify_once(path: str | os.PathLike, expected: dict, *, hint: str = "") -> bool:
    """`verify_file`, once per process for a file unchanged since (same size, mtime and
    expected entry): a file opened by preflight and again by the trainer is hashed once.
    Returns True when it hashed the file now."""
    p = Path(path)
    key = _once_key(p, expected)
    if key is not None and key in _verified:
        return False
    verify_file(p, expected, hint=hint)
    with _verified_lock:
        _verified.add(key)
    return True


def mark_verified(path: str | os.PathLike, expected: dict) -> None:
    """Record `path` as verified against `expected` in this process (`verify_once` then skips
    it while it is unchanged): for a file hashed as it was written or downloaded."""
    key = _once_key(Path(path), expected)
    if key is not None:
        with _verified_lock:
            _verified.add(key)


def _once_key(p: Path, expected: dict) -> tuple | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return (str(p.resolve()), st.st_size, st.st_mtime_ns, json.dumps(expected, sort_keys=True))


def read_marker(directory: str | os.PathLike, name: str) -> dict:
    """The marker's JSON; FileNotFoundError / IntegrityError when missing or unreadable."""
    path = Path(directory) / name
    try:
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no completion marker; the job that writes it did not finish "
            "(still running, or crashed)"
        ) from None
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{path}: unreadable completion marker ({e})") from None
    if not isinstance(marker, dict):
        raise IntegrityError(f"{path}: completion marker is not a JSON object")
    return marker


@dataclass
class FileReport:
    """One file's verdict: `error` is None when it verified."""

    name: str
    bytes: int | None
    error: str | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None


def verify_listed(directory: str | os.PathLike, checksums: dict[str, dict]) -> list[FileReport]:
    """Hash every file the marker lists (in name order); a report per file, never raises on
    damage. The function a reader of any marked directory (shards, cache, checkpoint) reuses."""
    d = Path(directory)
    out = []
    for name in sorted(checksums):
        e = checksums[name]
        try:
            verify_file(d / name, e)
            out.append(FileReport(name, int(e["bytes"]), note=describe(e)))
        except IntegrityError as err:
            out.append(FileReport(name, int(e.get("bytes", -1)), error=str(err)))
    return out


def verify_dir(directory: str | os.PathLike, *, marker: str = "COMPLETED") -> list[FileReport]:
    """`verify_listed` over the checksums of `directory`'s completion marker."""
    return verify_listed(directory, read_marker(directory, marker).get("checksums", {}))


def write_json_atomic(path: str | os.PathLike, obj: dict) -> None:
    """A marker: temporary file, fsync, rename (a reader sees the old or the whole new one)."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    atomic.write(p, json.dumps(obj, indent=2, sort_keys=True) + "\n", fsync=True, tmp=tmp)
