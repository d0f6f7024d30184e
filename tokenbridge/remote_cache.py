"""A node-local cache of inputs fetched from an object store, verified while they download.

Shared by the trainer's inputs and checkpoints, the Beam workers' tokenizers and teachers
(`tokenbridge.remote_models`), ``verify`` on an ``s3://`` directory and the teacher-cache
launcher. A marked directory is fetched marker first, each file hashed on its way in and
refused by name when it differs, ``.fetched`` last (the entry's commit point); one process per
entry fetches (local rank 0, else the holder of the entry's lock), and whole entries are evicted
by last use to stay under `limit_bytes`. The protocol: docs/pipelines.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from tokenbridge import atomic, urls
from tokenbridge.formats import checksums

FETCHED = ".fetched"  # an entry's commit point: written after every file is in place
WAIT_S = 3600.0  # how long a rank waits for its node's fetch
POLL_S = 0.2
LOCKS = ".locks"  # one lock file per entry (kept: removing one races with a waiter)


def default_dir() -> Path:
    """This process's cache directory: ``$XDG_CACHE_HOME/tokenbridge``, else
    ``~/.cache/tokenbridge`` (read now: a worker has its own HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenbridge"


DEFAULT_DIR = default_dir()  # the launching process's (what the commands' help texts show)


@functools.cache
def _filesystem(settings: tuple[tuple[str, str], ...], retries: tuple[tuple[str, object], ...]):
    import s3fs

    return s3fs.S3FileSystem(**urls.fsspec_options(dict(settings), retries=dict(retries)))


def filesystem():
    """The s3fs file system of the environment's settings (`urls.s3_settings`, its retries:
    `urls.retry_config`)."""
    settings, retries = urls.s3_settings(), urls.retry_config()
    return _filesystem(tuple(sorted(settings.items())), tuple(sorted(retries.items())))


def errors(url: str, doing: str):
    """The store's failures as one line naming `url` (`urls.store_errors`); a damaged file's
    own error as it is."""
    return urls.store_errors(url, doing=doing, keep=(checksums.IntegrityError,))


def entry_name(url: str) -> str:
    """A cache entry's directory name: the URL's last part, readable, and a digest of it all."""
    digest = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]
    return f"{urls.name(url)[:48]}-{digest}"


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created if missing) for the block: one fetcher per entry
    among this machine's processes (the lock goes with the process if it dies)."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class RemoteCache:
    """A node-local cache of fetched inputs: one entry (directory) per URL."""

    def __init__(self, root: str | os.PathLike, *, limit_bytes: int, local_rank: int):
        self.root, self.limit, self.local_rank = Path(root), int(limit_bytes), local_rank
        self.in_use: set[Path] = set()  # entries this run reads: never evicted

    def entry(self, url: str) -> Path:
        return self.root / entry_name(url)

    def fetch_dir(self, url: str, *, marker: str = "COMPLETED", named: bool = False) -> Path:
        """The local copy of the marked directory `url`, fetched and verified if needed. With
        `named`, the copy is a directory named as the URL's last part inside the entry (a
        tokenizer loaded from it takes that name, as from the directory it was uploaded from)."""
        sub = urls.name(url) if named else ""
        entry = self._fetch(url, lambda entry: self._download_dir(url, entry / sub, marker))
        return entry / sub if sub else entry

    def fetch_file(self, url: str) -> Path:
        """The local copy of the single file `url` (no marker: unverified)."""
        name = urls.name(url)
        return self._fetch(url, lambda entry: self._download_file(url, entry, name)) / name

    def _fetch(self, url: str, download) -> Path:
        entry = self.entry(url)
        done = entry / FETCHED
        self.in_use.add(entry)
        if self.local_rank != 0:  # the node's rank 0 fetches; this one waits for its commit
            deadline = time.monotonic() + WAIT_S
            while not done.is_file():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url}: local rank 0 did not fetch it into {entry}")
                time.sleep(POLL_S)
            return entry
        (self.root / LOCKS).mkdir(parents=True, exist_ok=True)
        with locked(self.root / LOCKS / entry.name):
            if done.is_file():  # fetched before, or by the process that held the lock
                done.touch()  # its last use: what eviction orders by
                return entry
            shutil.rmtree(entry, ignore_errors=True)  # a fetch that died half way
            entry.mkdir(parents=True)
            try:
                download(entry)
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)
                raise
        return entry

    def _make_room(self, need: int, url: str) -> None:
        """Evict whole entries, least recently used first, until `need` more bytes fit."""
        if need > self.limit:
            raise ValueError(
                f"{url}: {need / 1e9:.2f} GB does not fit the local cache (data.cache_limit_gb="
                f"{self.limit / 1e9:g}); raise the limit or point data.cache_dir at a larger disk"
            )
        entries = [e for e in self.root.iterdir() if (e / FETCHED).is_file()]
        used = sum(_size(e) for e in entries)
        for e in sorted(entries, key=lambda e: (e / FETCHED).stat().st_mtime):
            if used + need <= self.limit:
                break
            if e not in self.in_use:
                used -= _size(e)
                shutil.rmtree(e, ignore_errors=True)

    def _download_dir(self, url: str, dest: Path, marker: str) -> None:
        """The marked directory `url` into `dest` (the entry, or a directory inside it)."""
        raw, parsed = read_marker_url(url, marker)
        sums = parsed.get("checksums", {})
        self._make_room(sum(int(e["bytes"]) for e in sums.values()), url)
        dest.mkdir(parents=True, exist_ok=True)
        for name in sorted(sums):
            download(urls.join(url, name), dest / name, expected=sums[name])
        (dest / marker).write_bytes(raw)
        _commit(self.entry(url), url)

    def _download_file(self, url: str, entry: Path, name: str) -> None:
        fs = filesystem()
        with errors(url, "a lookup"):
            size = int(fs.size(urls.store_key(url)))
        self._make_room(size, url)
        download(url, entry / name, expected=None)
        _commit(entry, url)


class MarkerNotFoundError(FileNotFoundError):
    """A directory URL without its completion marker (one line, exit 2)."""


def read_marker_url(url: str, marker: str = "COMPLETED") -> tuple[bytes, dict]:
    """The completion marker of the directory `url`: its bytes and its JSON;
    `MarkerNotFoundError` (one line) when there is none."""
    marker_url = urls.join(url, marker)
    with errors(marker_url, "a read"):
        try:
            raw = filesystem().cat_file(urls.store_key(marker_url))
        except FileNotFoundError:
            raise MarkerNotFoundError(
                f"{marker_url}: no completion marker; the job that writes it did not finish "
                "(still running, or crashed), or the URL is wrong"
            ) from None
    return raw, json.loads(raw)


def download(url: str, dest: Path, *, expected: dict | None) -> None:
    """`url` to `dest`, hashed on its way (`HashingSink`), renamed into place once whole and,
    when `expected` (a marker entry), equal to it (else `DamagedFileError`, nothing kept)."""
    fs = filesystem()
    part = dest.with_name(f".{dest.name}.part")
    sink = checksums.HashingSink(
        part, algo=checksums.entry_algo(expected) if expected else checksums.HASH
    )
    try:
        with errors(url, "a read"), fs.open(urls.store_key(url), "rb", block_size=8 << 20) as src:
            while block := src.read(8 << 20):
                sink.write(block)
        sink.close()
    finally:
        sink.close()
    if expected is not None:
        found = sink.entry()
        if found != checksums.entry(int(expected["bytes"]), expected[sink.algo], sink.algo):
            part.unlink(missing_ok=True)
            raise checksums.DamagedFileError(
                url, expected=checksums.describe(expected), found=checksums.describe(found),
                hint="the object differs from its completion marker: re-run the job that wrote it",
            )  # fmt: skip
    atomic.replace(part, dest)
    if expected is not None:  # hashed on its way: the reader that maps it need not hash it again
        checksums.mark_verified(dest, expected)


def _commit(entry: Path, url: str) -> None:
    checksums.write_json_atomic(entry / FETCHED, {"url": url, "fetched": time.time()})


def _size(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
