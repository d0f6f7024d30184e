"""``.gpucheck/``: what a bare GPU machine needs for `make gpu-check` beyond the working tree.

Such a machine has its own Python with PyTorch and transformers, no network, no `.venv` and no
`artifacts/`; the check needs no weights, but does need the tokenizers, some text and a few
pure-Python packages. docs/gpu.md lists the folder and how to carry it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tokenbridge import paths

PACK = paths.REPO_ROOT / ".gpucheck"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CORPUS_FILES = 3  # plays: the CUDA tests read the first; the shards and prompts ~300k characters
# what the trainer imports that a stock PyTorch image lacks: pure Python, so copied without
# bytecode they import on the GPU machine's Python as they are
SITE_PACKAGES = ("hydra", "omegaconf", "antlr4")


def commit() -> str:
    """This checkout's short commit (``-dirty`` with uncommitted changes to tracked files), or
    the pack's ``COMMIT`` where there is no git, or ``unknown``."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=paths.REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=paths.REPO_ROOT, capture_output=True, text=True).stdout  # fmt: skip
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        f = PACK / "COMMIT"
        return f.read_text().strip() if f.is_file() else "unknown"


def _copy_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def write_pack(out: Path = PACK) -> dict[str, int]:
    """Write the folder (replacing an older one); returns bytes per top-level part."""
    shutil.rmtree(out, ignore_errors=True)
    models = out / "artifacts" / "models"
    for src in (paths.teacher_dir(), paths.student_dir()):
        dst = models / src.name
        dst.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            if f.is_file() and f.suffix not in WEIGHTS:
                shutil.copyfile(f, dst / f.name)
    plays = out / "artifacts" / "corpus" / "shakespeare"
    plays.mkdir(parents=True)
    for f in sorted((paths.corpus_dir() / "shakespeare").glob("*.txt"))[:CORPUS_FILES]:
        shutil.copyfile(f, plays / f.name)
    for name in SITE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"{name} is not installed here: run `make setup` first")
        _copy_tree(Path(spec.origin).parent, out / "site" / name)
    (out / "COMMIT").write_text(commit() + "\n")
    return {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir()
        else p.stat().st_size
        for p in sorted(out.iterdir())
    }  # fmt: skip


def use_pack(pack: Path = PACK) -> list[str]:
    """Use the pack for what this checkout lacks, for this process and those it starts: its
    artifacts where ``artifacts/`` has no models and ``TOKENBRIDGE_ARTIFACTS`` is unset, its
    packages where Hydra is not importable. Returns what was used."""
    used: list[str] = []
    if not pack.is_dir():
        return used
    if (
        "TOKENBRIDGE_ARTIFACTS" not in os.environ
        and not (paths.teacher_dir() / "config.json").is_file()
    ):
        os.environ["TOKENBRIDGE_ARTIFACTS"] = str(pack / "artifacts")
        used.append("artifacts")
    if importlib.util.find_spec("hydra") is None:
        site = str(pack / "site")
        sys.path.insert(0, site)
        # for the processes the check starts: pytest, its trainer runs, teacher workers
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, os.environ.get("PYTHONPATH")) if p
        )
        used.append("site")
    return used


def main() -> None:
    sizes = write_pack()
    total = sum(sizes.values())
    for name, n in sizes.items():
        print(f"  {name}: {n / 2**20:.1f} MiB")
    print(f"wrote {PACK} ({total / 2**20:.1f} MiB): carry it to the GPU machine (docs/gpu.md)")


if __name__ == "__main__":
    main()
