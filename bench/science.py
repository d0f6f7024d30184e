"""The science table (issue 16): every loss mode vs CE-only vs TRL's GOLD loss, same budget.

``make science`` (or ``python -m bench.science``). Every row trains the same student
(SmolLM2-135M) from the same teacher (Gemma-3-270M) on the same shards (the demo's corpus: the
KJV New Testament letters, one document per chapter, whole chapters held out), for the same
steps with the same optimizer, one row per loss mode; each row is run for every seed. Then:

- **in-domain**: the run's own held-out bits per byte (summary.json: windows of held-out
  documents, never trained on);
- **out-of-domain**: the eval suite's ``text:`` bits per byte of a Shakespeare play (a text no
  row trains on, where the teacher barely leads: does a row forget?), at ``--ood-limit`` chunks;
- **suite**: the eval suite's bits-per-byte rows (``bpb`` group: GSM8K, MATH, HumanEval, MBPP
  reference answers) at ``--limit``, on seed 0 of each row (CPU time; said in the table);
- **train s**: the run's seconds in steps.

Rows that read the teacher from the offline cache (``make teacher-cache``; the cache row must
equal the live one, so ``xtoken (live teacher)`` runs once beside it) and CE run two at a time
on one thread each; rows with a live teacher (gold, TRL's GOLD, on-policy) run alone, the
teacher in its worker on the second core. Finished pieces are kept (summary.json, eval JSON):
a second call resumes. Results: ``<out>/results.json``; the table: ``<out>/science.md``
(``bench/science_table.py`` renders it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.science_table import render
from tokenbridge import paths

REPO = Path(__file__).resolve().parent.parent
SHARDS = REPO / "outputs" / "align" / "letters"
CACHE = REPO / "outputs" / "cache" / "letters"
OOD_TEXT = "artifacts/corpus/shakespeare/hamlet_gut.txt"
PY = sys.executable


@dataclass(frozen=True)
class Row:
    """One row of the table: a label, its trainer overrides and how its teacher runs."""

    label: str
    overrides: tuple[str, ...]
    teacher: str  # none | cache | live
    launcher: str = "trainer"  # trainer | trl (bench.trl_gold_train: TRL's loss registered)
    seeds: tuple[int, ...] | None = None  # None: every --seeds
    lr_check: bool = False


ONPOLICY = (
    "onpolicy.enabled=true", "loss=ce", "onpolicy.loss=xtoken",
    "+onpolicy.options={xtoken:{k:32,divergence:reverse}}", "onpolicy.lag=1",
    "onpolicy.prompt_tokens=64", "onpolicy.prompts_per_step=2", "onpolicy.max_new_tokens=64",
    "onpolicy.top_p=0.95", "onpolicy.eval_prompts=0",
)  # fmt: skip

ROWS = {
    "ce": Row("CE only", ("loss=ce", "teachers=none"), "none", lr_check=True),
    "xtoken": Row("xtoken forward", ("loss=xtoken",), "cache", lr_check=True),
    "xtoken_rev": Row(
        "xtoken reverse", ("loss=xtoken", "loss.options.divergence=reverse"), "cache"
    ),
    "xtoken_chain": Row(
        "xtoken + chain", ("loss=xtoken", "loss.options.chain_weight=1.0"), "cache"
    ),
    "alm": Row("alm", ("loss=alm",), "cache"),
    "gold": Row("gold (ours)", ("loss=gold",), "live"),
    "onpolicy": Row("on-policy xtoken (reverse)", ONPOLICY, "live"),
    "trl_gold": Row(
        "TRL GOLD (hybrid ULD, TRL's code)",
        ("loss=ce", "loss.mode=trl_gold", "loss.kd_weight=1.0"),
        "live",
        launcher="trl",
    ),
    "xtoken_live": Row("xtoken forward, live teacher", ("loss=xtoken",), "live", seeds=(0,)),
}


@dataclass
class Job:
    row: str
    seed: int
    lr: float
    run_dir: Path
    cmd: list[str] = field(default_factory=list)
    light: bool = True


def base_overrides(args, *, seed: int, lr: float, run_dir: Path) -> list[str]:
    return [
        "conf=demo", f"run_dir={run_dir}", f"name={run_dir.name}", f"steps={args.steps}",
        f"seed={seed}", f"data.seed={seed}", f"optim.lr={lr}", f"data.shards={SHARDS}",
        "checkpoint.save_at_end=false", "checkpoint.export_at_end=true", "logging.progress=false",
        "logging.tensorboard=false", "eval.teacher=false", "parallel.threads=1",
    ]  # fmt: skip


def plan(args) -> list[Job]:
    """Every (row, seed, lr) to run, light ones first (they pair up two at a time)."""
    jobs = []
    for key in args.rows:
        row = ROWS[key]
        lrs = [args.lr] + (list(args.lr_check) if row.lr_check else [])
        for lr in lrs:
            seeds = row.seeds or (args.seeds[:1] if key in args.single_seed else args.seeds)
            for seed in seeds:
                if lr != args.lr and seed != args.seeds[0]:
                    continue  # the LR check: one seed
                run_dir = args.out / "runs" / f"{key}__lr{lr:g}__s{seed}"
                over = base_overrides(args, seed=seed, lr=lr, run_dir=run_dir)
                over += list(row.overrides) + list(args.set)
                if key == "onpolicy":
                    over.append(f"onpolicy.seed={seed}")
                if row.teacher == "cache":
                    over.append(f"teachers.0.cache={CACHE}")
                if key in ("gold", "xtoken_live") and seed == args.seeds[0] and lr == args.lr:
                    over.append("eval.teacher=true")  # the teacher's number (a cache has none)
                mod = (
                    ["-m", "bench.trl_gold_train"] if row.launcher == "trl" else ["trainer/main.py"]
                )
                jobs.append(Job(key, seed, lr, run_dir, [PY, *mod, *over], row.teacher != "live"))
    return sorted(jobs, key=lambda j: not j.light)


def _sh(cmd: list[str], log: Path, *, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); {log}: {tail}")


def train(job: Job) -> dict:
    summary = job.run_dir / "summary.json"
    if not summary.is_file():
        shutil.rmtree(job.run_dir, ignore_errors=True)
        t = time.time()
        print(f"== train {job.run_dir.name}", flush=True)
        _sh(job.cmd, job.run_dir.with_suffix(".log"), threads=1)
        print(f"   done {job.run_dir.name} in {time.time() - t:.0f} s", flush=True)
    return json.loads(summary.read_text())


def evaluate(model: Path, tasks: str, limit: int, out: Path, *, threads: int) -> dict:
    """The eval suite's results for one model (kept: a second call reads them back)."""
    if not out.is_file():
        cmd = [PY, "-m", "trainer.eval", "--model", str(model), "--tasks", tasks,
               "--limit", str(limit), "--out", str(out), "--threads", str(threads),
               "--no-progress"]  # fmt: skip
        _sh(cmd, out.with_suffix(".log"), threads=threads)
    return read_eval(out)


def read_eval(path: Path) -> dict:
    """Task -> its primary metric (value, stderr) from one model's eval-suite JSON."""
    (res,) = json.loads(path.read_text())["models"].values()
    return {t: r["metrics"][r["primary"]] for t, r in res["results"].items()}


def finish(job: Job, args, *, threads: int) -> dict:
    """Train, then evaluate the export (OOD always, the suite on the first seed), then drop the
    export (a 540 MB copy per run)."""
    s = train(job)
    export = Path(s["export"]) if s.get("export") else job.run_dir / "export"
    evals = {}
    tasks = [("ood", f"text:{OOD_TEXT}", args.ood_limit)]
    if job.seed == args.seeds[0] and job.lr == args.lr and job.row in args.suite_rows:
        tasks.append(("suite", "bpb", args.limit))
    for name, t, limit in tasks:
        out = job.run_dir / f"eval_{name}.json"
        if out.is_file() or export.is_dir():
            evals[name] = evaluate(export, t, limit, out, threads=threads)
    if export.is_dir() and all((job.run_dir / f"eval_{n}.json").is_file() for n, *_ in tasks):
        shutil.rmtree(export)
    return {"row": job.row, "seed": job.seed, "lr": job.lr, "summary": s, "evals": evals}


def finished(args) -> list[dict]:
    """``--render-only``: the runs already finished under <out>/runs (nothing is run)."""
    out = []
    for summary in sorted((args.out / "runs").glob("*__lr*__s*/summary.json")):
        row, lr, seed = summary.parent.name.split("__")
        evals = {}
        for name in ("ood", "suite"):
            f = summary.parent / f"eval_{name}.json"
            if f.is_file():
                evals[name] = read_eval(f)
        if row in args.rows:
            out.append({"row": row, "seed": int(seed[1:]), "lr": float(lr[2:]),
                        "summary": json.loads(summary.read_text()), "evals": evals})  # fmt: skip
    return sorted(out, key=lambda r: (list(ROWS).index(r["row"]), r["lr"], r["seed"]))


def inputs(args) -> None:
    """The shards and the teacher cache the rows read (made once, kept)."""
    teacher, student = paths.teacher_dir(), paths.student_dir()
    if not (SHARDS / "COMPLETED").is_file():
        _sh([PY, "-m", "pipelines.align", "--data", "artifacts/corpus/kjv_letters.jsonl",
             "--teacher", str(teacher), "--student", str(student), "--out", str(SHARDS),
             "--overwrite", "--max-student-tokens", "256", "--max-teacher-tokens", "256"],
            args.out / "align.log", threads=2)  # fmt: skip
    if not (CACHE / "COMPLETED").is_file():
        # fp32 log-probs: the cached row equals the live one bit for bit (tests/e2e)
        _sh([PY, "-m", "pipelines.teacher_cache", "--shards", str(SHARDS), "--teacher",
             str(teacher), "--k", "32", "--logprob-dtype", "float32", "--threads", "2",
             "--rows-per-task", "32", "--out", str(CACHE), "--overwrite"],
            args.out / "cache.log", threads=2)  # fmt: skip


def baselines(args) -> dict:
    """The untouched student and the teacher, through the same evals (``--render-only``: the
    ones already there)."""
    out = {}
    for name, model in (("student", paths.student_dir()), ("teacher", paths.teacher_dir())):
        d = args.out / "baselines" / name
        d.mkdir(parents=True, exist_ok=True)
        wanted = [("ood", f"text:{OOD_TEXT}", args.ood_limit)]
        if args.suite_rows and name == "student":  # the goal compares with the untouched student
            wanted.append(("suite", "bpb", args.limit))
        out[name] = {
            key: evaluate(model, tasks, limit, d / f"eval_{key}.json", threads=2)
            for key, tasks, limit in wanted
            if not args.render_only or (d / f"eval_{key}.json").is_file()
        }
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "science")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=40, help="as conf=demo's (make demo)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--lr-check", default="1e-4,2e-4", help="more LRs for CE and xtoken (1 seed)")
    ap.add_argument(
        "--single-seed", default="trl_gold,onpolicy", help="rows run on the first seed only (CPU)"
    )
    ap.add_argument(
        "--suite-rows", default="ce,xtoken", help="rows whose first seed gets the eval suite (CPU)"
    )
    ap.add_argument("--limit", type=int, default=100, help="eval suite examples per task")
    ap.add_argument("--ood-limit", type=int, default=12, help="out-of-domain text chunks")
    ap.add_argument("--render-only", action="store_true", help="the table of finished runs")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every row (k=v)")
    args = ap.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        raise SystemExit(f"unknown rows {bad}; known: {list(ROWS)}")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.single_seed = [r for r in args.single_seed.split(",") if r]
    args.suite_rows = [r for r in args.suite_rows.split(",") if r]
    args.lr_check = [float(x) for x in args.lr_check.split(",") if x]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.render_only:
        results = finished(args)
    else:
        inputs(args)
        jobs = plan(args)
        results = []
        light, live = [j for j in jobs if j.light], [j for j in jobs if not j.light]
        with ThreadPoolExecutor(2) as pool:  # two one-thread runs on two cores
            results += list(pool.map(lambda j: finish(j, args, threads=1), light))
        results += [finish(j, args, threads=2) for j in live]
    payload = {"steps": args.steps, "lr": args.lr, "seeds": args.seeds, "limit": args.limit,
               "single_seed": args.single_seed, "suite_rows": args.suite_rows,
               "ood_limit": args.ood_limit, "ood_text": OOD_TEXT, "rows": {k: ROWS[k].label
               for k in args.rows}, "baselines": baselines(args), "runs": results,
               "seconds": time.time() - t0}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    text = render(payload)
    (args.out / "science.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
