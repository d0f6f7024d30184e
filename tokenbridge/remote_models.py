"""Model and tokenizer directories in an object store: marked, uploaded, fetched verified.

A Beam worker or training node shares no disk with its launcher, so a directory named by URL is
fetched by each machine once into its cache (`tokenbridge.remote_cache`) and checked against
the directory's ``COMPLETED`` marker (kind ``model``, written by `mark`); a directory without
one is refused, never read unverified. The copy keeps the directory's name, so a tokenizer
loaded from it has its local name and fingerprint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tokenbridge import urls
from tokenbridge.formats import checksums
from tokenbridge.remote_cache import (
    MarkerNotFoundError,
    RemoteCache,
    default_dir,
    errors,
    filesystem,
)

MARKER = "COMPLETED"
KIND = "model"
VERSION = 1
DEFAULT_LIMIT_BYTES = 50 * 10**9  # the node-local cache's size (least recently used evicted)


def mark(directory: str | os.PathLike) -> dict:
    """Write `directory`'s marker: every file directly in it (hidden ones and the marker left
    out) with its size and checksum. Returns the marker."""
    d = Path(directory)
    if not d.is_dir():
        raise NotADirectoryError(f"{d}: not a directory (a tokenizer file goes in one to upload)")
    files = sorted(
        p for p in d.iterdir() if p.is_file() and p.name != MARKER and not p.name.startswith(".")
    )
    if not files:
        raise FileNotFoundError(f"{d}: no files to mark")
    marker = {
        "kind": KIND,
        "version": VERSION,
        "hash": checksums.HASH,
        "marked": time.time(),
        "checksums": {p.name: checksums.hash_file(p) for p in files},
    }
    checksums.write_json_atomic(d / MARKER, marker)
    return marker


def upload(directory: str | os.PathLike, url: str, *, marker: dict | None = None) -> str:
    """Copy `directory` to `url` with its marker (`marker`: the one `mark` just wrote, else it
    is marked now): an earlier marker there removed first, every file, then the marker last (a
    reader never takes a half-uploaded directory for a whole one)."""
    urls.check(url, where="--upload", schemes=urls.OBJECT_STORES, doing="uploading to")
    d = Path(directory)
    marker = marker or mark(d)
    fs = filesystem()
    marker_key = urls.store_key(urls.join(url, MARKER))
    with errors(url, "a write"):
        if fs.exists(marker_key):
            fs.rm_file(marker_key)
        for name in sorted(marker["checksums"]):
            fs.put_file(str(d / name), urls.store_key(urls.join(url, name)))
        fs.put_file(str(d / MARKER), marker_key)
    return url


def fetch(cache: RemoteCache, url: str) -> Path:
    """The verified local copy of the marked directory `url` in `cache` (fetched if needed)."""
    try:
        return cache.fetch_dir(url, marker=MARKER, named=True)
    except MarkerNotFoundError:
        raise MarkerNotFoundError(
            f"{url}: no {MARKER} marker listing its files' checksums, so it is not read "
            f"(unverified); upload it with `python -m tokenbridge.commands.verify --mark DIR --upload {url}`"
        ) from None


def local_copy(
    path: str | os.PathLike,
    *,
    cache_dir: str | os.PathLike | None = None,
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
) -> str:
    """`path` itself when local; for a URL its verified copy in this machine's cache
    (`cache_dir`, default ``~/.cache/tokenbridge``), fetched by one process of the machine."""
    if not urls.is_url(path):
        return str(path)
    cache = RemoteCache(cache_dir or default_dir(), limit_bytes=limit_bytes, local_rank=0)
    return str(fetch(cache, str(path)))
