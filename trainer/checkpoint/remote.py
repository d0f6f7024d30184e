"""Checkpoints in an object store (``checkpoint.dir=s3://bucket/run/checkpoints``): DCP's fsspec
writer, the same files and marker as on a local disk, and resume through a verified local copy.

A store has no directory rename, so each step is written in place and ``COMPLETED``, written
last by rank 0, is the commit point; the local copy is then read by the local reader, under
every rule of `trainer.checkpoint.checkpointer` (docs/integrity.md, "Checkpoints").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from tokenbridge import urls
from tokenbridge.formats import checksums
from tokenbridge.remote_cache import RemoteCache, filesystem
from trainer.checkpoint.dcp_io import DamagedCheckpointError, HashingFileSystem
from trainer.checkpoint.dcp_io import Writer as LocalWriter

MARKER = "COMPLETED"
STEP_PREFIX = "step-"


class HashingFsspecFileSystem(HashingFileSystem):
    """`HashingFileSystem` whose files are objects (through `fs`, an fsspec file system)."""

    def __init__(self, fs):
        super().__init__()
        self.remote = FsspecFileSystem()
        self.remote.fs = fs

    def open_sink(self, path) -> checksums.HashingSink:
        return checksums.HashingSink(path, stream=self.remote.fs.open(str(path), "wb"))

    def rename(self, path, new_path) -> None:  # copy then delete on an object store
        self.remote.rename(str(path), str(new_path))
        with self._lock:
            if (e := self.entries.pop(urls.name(path), None)) is not None:
                self.entries[urls.name(new_path)] = e

    def concat_path(self, path, suffix: str) -> str:
        return urls.join(str(path), suffix)

    def init_path(self, path, **kwargs) -> str:
        return str(path)

    def mkdir(self, path) -> None:  # an object store has no directories
        pass

    def exists(self, path) -> bool:
        return self.remote.exists(str(path))

    def rm_file(self, path) -> None:
        self.remote.rm_file(str(path))

    def ls(self, path) -> list[str]:
        return self.remote.ls(str(path))


class Writer(FsspecWriter):
    """DCP's fsspec writer with `HashingFsspecFileSystem` and the JSON index (no file sync:
    an object is durable once its upload completes)."""

    finish = LocalWriter.finish

    def __init__(self, url: str):
        super().__init__(url, sync_files=False, **urls.fsspec_options())
        self.fs = HashingFsspecFileSystem(self.fs.fs)


def step_url(folder: str, step: int) -> str:
    return urls.join(folder, f"{STEP_PREFIX}{step:08d}")


def list_steps(folder: str) -> list[tuple[int, str]]:
    """Committed checkpoints under `folder` (those with ``COMPLETED``), oldest first."""
    fs, out = filesystem(), []
    fs.invalidate_cache()  # another process (rank 0, an earlier run) may have written since
    try:
        found = fs.glob(f"{urls.store_key(folder)}/{STEP_PREFIX}*/{MARKER}")
    except FileNotFoundError:
        return []
    for key in found:
        step = key.split("/")[-2][len(STEP_PREFIX) :]
        if step.isdigit():
            out.append((int(step), step_url(folder, int(step))))
    return sorted(out)


def clear(step: str) -> None:
    """Remove what a step holds (``COMPLETED`` first: never a marker over missing files)."""
    fs = filesystem()
    if fs.exists(urls.store_key(urls.join(step, MARKER))):
        fs.rm_file(urls.store_key(urls.join(step, MARKER)))
    if fs.exists(urls.store_key(step)):
        fs.rm(urls.store_key(step), recursive=True)
    fs.invalidate_cache()


def publish(folder: str, step: str, marker: dict, *, keep: int) -> None:
    """Rank 0, after every rank wrote `step`: its ``COMPLETED`` (the commit point), then only
    the newest `keep` checkpoints kept."""
    fs = filesystem()
    fs.pipe_file(urls.store_key(urls.join(step, MARKER)), json.dumps(marker, indent=2).encode())
    fs.invalidate_cache()
    for _, old in list_steps(folder)[:-keep]:
        clear(old)


def find_resume(folder: str, cfg, *, cache_dir: str | os.PathLike, limit_bytes: int):
    """The local, verified copy of the checkpoint to resume from under `folder` (or of
    ``cfg.resume`` when it names one), and the notes to print; (None, notes) to start fresh.
    The newest committed step is fetched into the node's input cache (local rank 0 fetches,
    each file hashed as it downloads); a damaged one is passed over for the next older one
    (``checkpoint.strict``: refused) and left in place, since the store cannot move it aside."""
    cache = RemoteCache(
        cache_dir, limit_bytes=limit_bytes, local_rank=int(os.environ.get("LOCAL_RANK", "0"))
    )
    if urls.is_url(cfg.resume):
        try:
            return cache.fetch_dir(cfg.resume, marker=MARKER), []
        except checksums.IntegrityError as e:
            raise DamagedCheckpointError(f"checkpoint.resume={cfg.resume}: {e}") from None
    notes: list[str] = []
    for _, url in reversed(list_steps(folder)):
        try:
            local = cache.fetch_dir(url, marker=MARKER)
        except checksums.IntegrityError as e:
            if cfg.strict:
                raise DamagedCheckpointError(
                    f"checkpoint {url} is damaged ({e}); checkpoint.strict=true refuses to fall "
                    "back to an older one: restore it, or run with checkpoint.strict=false"
                ) from None
            notes.append(f"checkpoint {url} is damaged ({e}); passed over")
            continue
        if notes:
            notes[-1] += f"; resuming from {urls.name(url)}"
        return Path(local), notes
    if notes:
        raise DamagedCheckpointError(
            "; ".join(notes) + f"; no checkpoint in {folder} verifies: restore one, or delete "
            "them to start from step 0"
        )
    return None, []
