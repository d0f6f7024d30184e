"""`make bench`: run the benchmark sections and write BENCHMARKS.md, its only writer.

`SECTIONS` names each section's module, whose ``main() -> str`` returns its Markdown. Each
section is stored under bench/results/ with its provenance line, so
``python -m bench.run_all NAME ...`` measures some and keeps the others (``--collect``: none).
docs/bench.md: how the sections measure, and when a kept one is called stale.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from bench import provenance

RESULTS = provenance.RESULTS
OUT = provenance.REPO / "BENCHMARKS.md"
KEPT = "_(cached:"  # a section's marker: not measurable here, its last run kept
# section name (its results file, `make bench BENCH=name`) -> its module under bench/
SECTIONS = {
    "align_chat": "align.chat",
    "align_dask": "align.on_dask",
    "align_job": "align.beam_job",
    "align_scale": "align.scale",
    "align_tokenize_gap": "align.tokenize_gap",
    "alignment": "align.alignment",
    "channel": "training.logit_channel",
    "channel_cuda": "gpu.channel_cuda",
    "demo": "training.demo",
    "dist_ops": "training.dist_ops",
    "eval": "training.eval",
    "gpu_check": "gpu.section",
    "integrity": "training.integrity",
    "logits": "training.logits",
    "losses": "training.losses",
    "memory": "training.memory",
    "object_store": "storage.object_store",
    "onpolicy": "onpolicy.section",
    "packing": "training.packed_rows",
    "packing_onpolicy": "onpolicy.rollout_packing",
    "parallel": "training.parallel",
    "projection": "align.projection_build",
    "science": "science.section",
    "served_teacher": "teacher.served_vs_live",
    "sharded_load": "training.sharded_load",
    "teacher_cache": "teacher.cache",
    "teacher_pass": "teacher.fused_pass",
    "trainer": "training.trainer_step",
}


def discover() -> list[str]:
    return sorted(SECTIONS)


def module_file(name: str) -> Path:
    """The file of section `name`'s module (read by `provenance.measured_paths`, not imported)."""
    return provenance.REPO / "bench" / (SECTIONS[name].replace(".", "/") + ".py")


def run_one(name: str, *, allow_load: bool) -> None:
    """Run section `name`'s ``main()`` and store its section with its provenance line."""
    prov = provenance.Provenance.start()
    if prov.load_start > prov.cores and not allow_load:
        raise SystemExit(
            f"bench {name}: load average {prov.load_start:.1f} exceeds the {prov.cores} cores; "
            "wait for an idle machine or pass --allow-load (the section will say so)"
        )
    print(f"== bench {name}", flush=True)
    t0 = time.perf_counter()
    section = importlib.import_module(f"bench.{SECTIONS[name]}").main()
    took = time.perf_counter() - t0
    if KEPT in section:
        print(f"   {name}: kept the last section (not measurable here)")
        _add_provenance(RESULTS / f"{name}.md", section)
        return
    title, _, body = section.strip().partition("\n")
    text = f"{title}\n\n{prov.line()}\n{body.rstrip()}\n\n_(section ran in {took:.0f} s)_\n"
    tmp = RESULTS / f"{name}.md.tmp"
    tmp.write_text(text)
    tmp.replace(RESULTS / f"{name}.md")


def _add_provenance(stored: Path, section: str) -> None:
    """A kept section stored before sections named their commit gets the provenance line its
    module now derives (from git, or from the run's own record), so staleness can be judged."""
    if not stored.is_file() or provenance.MARK in (text := stored.read_text()):
        return
    line = next((x for x in section.splitlines() if x.startswith(provenance.MARK)), None)
    if line:
        title, _, body = text.partition("\n")
        tmp = stored.with_suffix(".md.tmp")
        tmp.write_text(f"{title}\n\n{line}\n{body}")
        tmp.replace(stored)


def collect() -> str:
    """BENCHMARKS.md from the stored sections, a stale note under any kept from older code."""
    parts = [
        "# Benchmarks\n",
        "Written by `make bench` (`bench/run_all.py`); never edited by hand. Each section states "
        "the commit, machine, cores and load average it was measured with, and quotes ratios "
        "against a baseline measured in the same run, plus peak memory. A section that could not "
        "run on the last machine (CUDA) is kept from the run that measured it.\n",
    ]
    for name in discover():
        path = RESULTS / f"{name}.md"
        if not path.exists():
            parts.append(f"## {name}\n\nNot run yet (`make bench BENCH={name}`).\n")
            continue
        text = provenance.reflag(path.read_text())
        paths = provenance.measured_paths(module_file(name))
        note = provenance.stale_note(text, paths)
        parts.append(text if note is None else f"{text.rstrip()}\n\n{note}\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    known = discover()
    ap = argparse.ArgumentParser(
        prog="python -m bench.run_all",
        description="Run the benchmark sections and write BENCHMARKS.md (`make bench`).",
    )
    ap.add_argument(
        "names", nargs="*", metavar="NAME", help=f"sections to run (default: all of {known})"
    )
    ap.add_argument(
        "--allow-load", action="store_true", help="run on a loaded machine (the section says so)"
    )
    ap.add_argument(
        "--collect", action="store_true", help="only rebuild BENCHMARKS.md from bench/results/"
    )
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {known}")
    names = [] if args.collect else (args.names or known)
    RESULTS.mkdir(exist_ok=True)
    for name in names:
        run_one(name, allow_load=args.allow_load)
    tmp = OUT.with_suffix(".tmp")
    tmp.write_text(collect())
    tmp.replace(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
