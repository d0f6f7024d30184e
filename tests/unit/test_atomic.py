"""`tokenbridge.atomic`: a file or directory appears whole or not at all, no sibling left."""

import pytest

from tokenbridge import atomic


def test_write_replaces_whole_and_leaves_no_sibling(tmp_path):
    path = tmp_path / "m.json"
    atomic.write(path, "old", fsync=True)
    atomic.write(path, b"new", fsync=False, tmp=tmp_path / "m.json.tmp")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "m.json"
    atomic.write(path, "old", fsync=False)
    with pytest.raises(RuntimeError), atomic.replacing(path) as part:
        part.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_directory_replaces_a_directory(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale").write_text("x")
    with atomic.replacing(out, directory=True) as part:
        (part / "weights").write_text("w")
    assert sorted(p.name for p in out.iterdir()) == ["weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
