"""Files and directories that appear whole or not at all: write a hidden sibling, then rename.

A reader sees the old file or the whole new one, and a failed write leaves no sibling behind.
Whether the bytes are fsynced before the rename is the caller's choice: yes for what a crash
must not lose once a job said it wrote it (markers, shards), no for caches and reports.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def temp_path(final: str | os.PathLike) -> Path:
    """A hidden sibling name for `final`, unique to this call: ``.NAME.tmp-<12 hex>``."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex[:12]}")


def remove(path: Path) -> None:
    """Delete a file or a directory tree (a missing one is no error)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Rename `tmp` onto `final`. A directory at `final` (which a rename cannot overwrite) is
    moved aside first and deleted once `tmp` has its name."""
    tmp, final = Path(tmp), Path(final)
    if not (final.is_dir() and not final.is_symlink()):
        os.replace(tmp, final)
        return
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    remove(old)
    os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def replacing(
    final: str | os.PathLike, *, tmp: str | os.PathLike | None = None, directory: bool = False
) -> Iterator[Path]:
    """The path to write inside the block (a new directory if `directory`): on success it
    becomes `final` (`replace`), on an exception it is deleted and `final` left as it was.
    `tmp` names the sibling (default `temp_path`)."""
    path = Path(tmp) if tmp is not None else temp_path(final)
    if directory:
        path.mkdir(parents=True)
    try:
        yield path
        replace(path, final)
    finally:
        if path.exists() or path.is_symlink():
            remove(path)


def write(
    path: str | os.PathLike,
    data: bytes | str,
    *,
    fsync: bool,
    tmp: str | os.PathLike | None = None,
) -> None:
    """`data` (str: UTF-8) as the file `path`, through `tmp` (default `temp_path`); with
    `fsync` the bytes reach the disk before the rename."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path, tmp=tmp) as part, open(part, "wb") as f:
        f.write(raw)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
