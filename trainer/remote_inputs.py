"""The trainer's inputs at object-store URLs: fetched once per node into a bounded local cache,
verified, then read from the local copy exactly as a local input (memory-mapped).

``data.shards``, ``teachers[i].cache`` and ``teachers[i].projection`` may be ``s3://`` URLs
(`tokenbridge.urls`: the standard AWS variables say where the store is and who asks). Before
any model loads, `localize` replaces each URL in the config by its local copy under
``data.cache_dir``:

- a directory with a completion marker (shards, a teacher cache) is fetched marker first: no
  marker is the same refusal as for a local directory (the job did not finish); then every file
  the marker lists, each hashed while it downloads and refused by name when it differs from
  the marker (size or xxh3_64), under a temporary name renamed into place; the marker last,
  then ``.fetched``, the entry's commit point;
- a single file (a projection: it has no marker; its loader checks its fingerprints) the same
  way, unverified.

One process per node fetches (``LOCAL_RANK`` 0); the node's other ranks wait for ``.fetched``,
so each file crosses the network once per node. An entry already fetched is reused (and its
``.fetched`` touched). The cache holds at most ``data.cache_limit_gb``: before a fetch, whole
entries are evicted oldest first (by their last use) until the new one fits, never one this
run uses; an input larger than the limit is refused in one line.

What is not here (the trainer maps every shard file at start, for its row-length scan): a
window of files fetched one ahead of the reader, for datasets larger than a node's disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from tokenbridge import urls
from tokenbridge.formats import checksums as integrity

FETCHED = ".fetched"  # an entry's commit point: written after every file is in place
WAIT_S = 3600.0  # how long a rank waits for its node's fetch
POLL_S = 0.2
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenbridge"


@functools.cache
def _filesystem(settings: tuple[tuple[str, str], ...]):
    import s3fs

    return s3fs.S3FileSystem(**urls.fsspec_options(dict(settings)))


def filesystem():
    """The s3fs file system of the environment's settings (`urls.s3_settings`)."""
    return _filesystem(tuple(sorted(urls.s3_settings().items())))


@contextlib.contextmanager
def _errors(url: str, doing: str):
    """The store's failures as one line naming `url` (refused credentials: exit 2)."""
    try:
        yield
    except (FileNotFoundError, integrity.IntegrityError):
        raise
    except PermissionError as e:
        raise urls.StorageAccessError(
            f"{url}: the object store refused {doing} ({e}); check AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL"
        ) from None
    except OSError as e:
        if urls.denied(str(e)):
            raise urls.StorageAccessError(
                f"{url}: the object store refused {doing}; check AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL"
            ) from None
        raise


class RemoteCache:
    """A node-local cache of fetched inputs: one entry (directory) per URL."""

    def __init__(self, root: str | os.PathLike, *, limit_bytes: int, local_rank: int):
        self.root, self.limit, self.local_rank = Path(root), int(limit_bytes), local_rank
        self.in_use: set[Path] = set()  # entries this run reads: never evicted

    def entry(self, url: str) -> Path:
        digest = hashlib.sha1(url.rstrip("/").encode()).hexdigest()[:16]
        return self.root / f"{urls.name(url)[:48]}-{digest}"

    def fetch_dir(self, url: str, *, marker: str = "COMPLETED") -> Path:
        """The local copy of the marked directory `url`, fetched and verified if needed."""
        return self._fetch(url, lambda entry: self._download_dir(url, entry, marker))

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
        if done.is_file():
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

    def _download_dir(self, url: str, entry: Path, marker: str) -> None:
        fs = filesystem()
        marker_url = urls.join(url, marker)
        with _errors(marker_url, "a read"):
            try:
                raw = fs.cat_file(urls.store_key(marker_url))
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"{marker_url}: no completion marker; the job that writes it did not finish "
                    "(still running, or crashed), or the URL is wrong"
                ) from None
        sums = json.loads(raw).get("checksums", {})
        self._make_room(sum(int(e["bytes"]) for e in sums.values()), url)
        for name in sorted(sums):
            _download(fs, urls.join(url, name), entry / name, expected=sums[name])
        (entry / marker).write_bytes(raw)
        _commit(entry, url)

    def _download_file(self, url: str, entry: Path, name: str) -> None:
        fs = filesystem()
        with _errors(url, "a lookup"):
            size = int(fs.size(urls.store_key(url)))
        self._make_room(size, url)
        _download(fs, url, entry / name, expected=None)
        _commit(entry, url)


def _download(fs, url: str, dest: Path, *, expected: dict | None) -> None:
    """`url` to `dest`, hashed on its way (`HashingSink`), renamed into place once whole and,
    when `expected` (a marker entry), equal to it."""
    part = dest.with_name(f".{dest.name}.part")
    sink = integrity.HashingSink(
        part, algo=integrity.entry_algo(expected) if expected else integrity.HASH
    )
    try:
        with _errors(url, "a read"), fs.open(urls.store_key(url), "rb", block_size=8 << 20) as src:
            while block := src.read(8 << 20):
                sink.write(block)
        sink.close()
    finally:
        sink.close()
    if expected is not None:
        found = sink.entry()
        if found != integrity.entry(int(expected["bytes"]), expected[sink.algo], sink.algo):
            part.unlink(missing_ok=True)
            raise integrity.DamagedFileError(
                url, expected=integrity.describe(expected), found=integrity.describe(found),
                hint="the object differs from its completion marker: re-run the job that wrote it",
            )  # fmt: skip
    os.replace(part, dest)


def _commit(entry: Path, url: str) -> None:
    integrity.write_json_atomic(entry / FETCHED, {"url": url, "fetched": time.time()})


def _size(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())


def localize(cfg) -> dict[str, tuple[str, str]]:
    """Replace every object-store URL among the run's inputs (``data.shards``,
    ``teachers[i].cache``, ``teachers[i].projection``) by its verified local copy, in `cfg`
    (a `TrainConfig`); returns {field: (URL, local copy)}. Every rank calls it (preflight)."""
    cache = RemoteCache(
        cfg.data.cache_dir or DEFAULT_DIR,
        limit_bytes=int(cfg.data.cache_limit_gb * 1e9),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    was: dict[str, tuple[str, str]] = {}
    if urls.is_url(cfg.data.shards):
        url, cfg.data.shards = cfg.data.shards, str(cache.fetch_dir(cfg.data.shards))
        was["data.shards"] = (url, cfg.data.shards)
    for i, t in enumerate(cfg.teachers):
        if urls.is_url(t.cache):
            url, t.cache = t.cache, str(cache.fetch_dir(t.cache))
            was[f"teachers[{i}].cache"] = (url, t.cache)
        if urls.is_url(t.projection):
            url, t.projection = t.projection, str(cache.fetch_file(t.projection))
            was[f"teachers[{i}].projection"] = (url, t.projection)
    return was
