"""`make gpu-check`: exercise and time what only a GPU runs, in under 6 minutes on one GPU.

Six parts (`parts`), each held to its own budget: a part that fails or runs out of time is
recorded and the others still run, and the JSON is rewritten after each part, so a run cut short
keeps what it measured. ``--dry-run`` runs every part on the CPU at tiny shapes (a test runs it,
so the script cannot rot). docs/gpu.md: the parts, their figures, carrying it to a bare machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import provenance
from bench.gpu.pack import commit, use_pack

RESULTS = provenance.RESULTS
DRY_OUT = provenance.REPO / "outputs" / "gpu_check_dry"
# the whole run's budget: each part gets at most its own, and what earlier parts left unused
# carries on to later ones (`main`); with the start-up, under 6 minutes in all
BUDGET_S = 355.0
DRY_PART_S = 120.0  # a dry-run part's budget (a loaded 2-core machine)


# ---------------------------------------------------------------------------------------------
# the parts


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    budget_s: float  # on a GPU
    run: Callable  # (Context, budget_s) -> figures


def parts() -> list[Part]:
    from bench.gpu import check_cases, check_train

    # the unproven parts first (3 never gave a figure; 6 and 5 changed since the last GPU run),
    # so a run cut short, or a short lease, spends its time where nothing is known yet
    return [
        Part("scale_1b_4b", "3. ~1.2B student from ~3.9B teacher, 4k-token rows, AC", 90,
             lambda ctx, _: check_train.scale_1b_4b(ctx)),
        Part("teacher_program", "6. Teacher program (cache job's outputs) vs bare HF forward", 25,
             lambda ctx, _: check_cases.teacher_program(ctx)),
        Part("sampler", "5. On-policy sampler vs HF generate", 100,
             lambda ctx, budget: check_cases.sampler_vs_generate(ctx, budget_s=budget)),
        Part("cuda_tests", "1. CUDA-marked tests (pytest -m cuda)", 65,
             lambda ctx, budget: check_cases.run_cuda_tests(ctx, budget_s=budget)),
        Part("long_row", "4. One 32k-token row: chunked vs whole logits", 30,
             lambda ctx, _: check_train.long_row(ctx)),
        Part("demo_pair", "2. Demo pair (Gemma-3-270M -> SmolLM2-135M shapes), 2k-token rows", 45,
             lambda ctx, _: check_train.demo_pair(ctx)),
    ]  # fmt: skip


def run_part(part: Part, ctx, *, limit_s: float) -> dict:
    """One part under `limit_s`: its figures and status (ok, skipped, failed, timeout)."""
    import torch

    from bench.gpu.check_cases import PartTimeout, time_limit

    rec: dict = {"title": part.title, "budget_s": round(limit_s, 1), "figures": {}}
    if limit_s < 5:
        return {**rec, "status": "skipped", "reason": "no time left in the run's budget"}
    t0 = time.perf_counter()
    try:
        # the pytest part kills its own process group at the budget; this is the backstop
        with time_limit(limit_s + (30 if part.key == "cuda_tests" else 0)):
            figures = part.run(ctx, limit_s)
        rec["figures"] = {k: v for k, v in figures.items() if v is not None}
        rec.setdefault("status", "ok")
        if time.perf_counter() - t0 > limit_s:  # its time limit fired where it could not stop it
            rec.setdefault("reason", "finished after its budget")
    except PartTimeout as e:
        rec["status"], rec["error"] = "timeout", str(e)
    except Exception as e:
        rec["status"] = "failed"
        rec["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]
        rec["traceback"] = traceback.format_exc()[-6000:]
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    gc.collect()
    if ctx.gpu:
        torch.cuda.empty_cache()
    return rec


def device_info(device) -> dict:
    import torch
    import transformers

    info = {"device": "cpu", "driver": None, "cuda": None, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "host_cpus": os.cpu_count()}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, driver=_driver())  # fmt: skip
    return info


def _driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py: on the GPU images; no process to start

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:
        return None


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, list):
        return f"{len(v)} items"
    return f"{v:,}" if isinstance(v, int) else str(v)


# the figures users compare, each from its part: (what, part, figure key, the goal)
HEADLINE = (
    ("student tokens/s per GPU, demo pair (xtoken, teacher in its worker)", "demo_pair",
     "student_tokens_per_s", ""),
    ("MFU of the student, demo pair", "demo_pair", "mfu_student", ""),
    ("distill step / CE-only step, demo pair, 2k tokens", "demo_pair", "distill_over_ce_step",
     "<= 1.3"),
    ("the same, teacher in process on its own stream", "demo_pair", "inprocess_over_ce_step",
     "<= 1.3"),
    ("student tokens/s per GPU, ~1.2B from ~3.9B, 4k tokens, AC", "scale_1b_4b",
     "student_tokens_per_s", ""),
    ("MFU of the ~1.2B student", "scale_1b_4b", "mfu_student", ">= 0.35"),
    ("teacher program / bare forward (tokens/s)", "teacher_program", "cache_forward_over_hf",
     ">= 0.8"),
    ("decode step: ours over HF generate (tokens/s)", "sampler", "ours_over_hf", ">= 4"),
    ("decode step / weight-read time", "sampler", "ours_over_floor", ""),
    ("peak memory GiB, demo pair step", "demo_pair", "peak_memory_gib", ""),
    ("peak memory GiB, ~1.2B / ~3.9B step", "scale_1b_4b", "peak_memory_gib", ""),
)  # fmt: skip


def headline(result: dict) -> list[str]:
    """The table of `HEADLINE` figures, saying why where a part gave none."""
    d = result["device"]
    lines = [f"Figures users compare ({d['device']}, driver {d['driver']}, torch {d['torch']}, "
             f"commit `{result['commit']}`):", "", "| figure | value | goal |", "|---|---:|---:|"]  # fmt: skip
    for what, key, name, goal in HEADLINE:
        part = result["parts"].get(key) or {"status": "part not run", "figures": {}}
        value = part["figures"].get(name)
        if value is not None:
            shown = _fmt(value)
        elif part["status"] == "ok":  # e.g. MFU on a device whose peak FLOP/s is not known
            shown = "not given by the part"
        else:
            shown = f"not run ({part['status']})"
        lines.append(f"| {what} | {shown} | {goal} |")
    return lines


def render(result: dict) -> str:
    """The Markdown section: the machine, then one table per part."""
    d = result["device"]
    where = (f"one {d['device']} ({d.get('memory_gib')} GiB), driver {d['driver']}, CUDA "
             f"{d['cuda']}" if d["cuda"] else "CPU")  # fmt: skip
    runs = result.get("runs")  # several runs merged by bench.gpu.check_merge
    when = (f"{len(runs)} runs on one machine (each part's run is in its row)" if runs else
            f"commit `{result['commit']}`, {result['date']}; {result['total_s']:.0f} s in all")  # fmt: skip
    # the provenance line `bench.provenance` reads (the oldest run's commit: stale from there)
    first = (runs or [result])[0]
    commit = first["commit"].removesuffix("-dirty")[:10]
    lines = [
        "## GPU check (`make gpu-check`)",
        "",
        f"{provenance.MARK}{commit}{'+dirty' if first['commit'].endswith('-dirty') else ''}, "
        f"{first['date'][:16].replace('T', ' ')} UTC, {d['device'] if d['cuda'] else 'CPU'}; "
        "load average not recorded._",
        "",
        f"Measured on {where}; torch {d['torch']}, transformers {d['transformers']}, Python "
        f"{d['python']}; {when}. Random-init models from the shipped config.json files (no "
        "weights), the real tokenizers, the shipped corpus; bf16 on the GPU. Ratios are within "
        "one run.",
    ]
    if runs:
        lines += [""] + [f"- run {i}: commit `{r['commit']}`, {r['date']}, {r['total_s']:.0f} s"
                         for i, r in enumerate(runs, 1)]  # fmt: skip
    if result.get("note"):
        lines += ["", result["note"]]
    if result["dry_run"]:
        lines += ["", "**Dry run** (CPU, tiny shapes and lengths): the figures check the "
                  "script and measure nothing."]  # fmt: skip
    lines += ["", *headline(result)]
    lines += ["", "| part | status | seconds |" + (" run |" if runs else ""),
              "|---|---|---:|" + ("---:|" if runs else "")]  # fmt: skip
    for p in result["parts"].values():
        why = p.get("reason") or p.get("error", "")
        why = f" ({why[:200]})".replace("\n", " ").replace("|", "/") if why else ""
        run = f" {p['run']} |" if runs else ""
        lines.append(f"| {p['title']} | {p['status']}{why} | {p['seconds']:.0f} |{run}")
    for p in result["parts"].values():
        if not p["figures"]:
            continue
        lines += ["", f"**{p['title']}**", "", "| figure | value |", "|---|---:|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in p["figures"].items() if v is not None]
    return "\n".join(lines) + "\n"


def _write(out: Path, result: dict) -> None:
    for name, text in (("gpu_check.json", json.dumps(result, indent=2) + "\n"),
                       ("gpu_check.md", render(result))):  # fmt: skip
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.gpu.check", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks the script")
    ap.add_argument("--out", type=Path, help=f"default {RESULTS} ({DRY_OUT} for a dry run)")
    ap.add_argument("--only", action="append", help="run only this part (repeatable)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's budget")
    ap.add_argument("--compile", action="store_true", help="part 3 with parallel.compile=true")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    used = use_pack()  # before anything imports Hydra or reads the artifacts

    import torch

    from bench.gpu.check_cases import DRY, GPU, Context

    unknown = set(args.only or ()) - {p.key for p in parts()}
    if unknown:
        ap.error(f"--only: no part {sorted(unknown)}; parts: {[p.key for p in parts()]}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --dry-run to check the script on CPU)",
              file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    out = args.out or (DRY_OUT if args.dry_run else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    ctx = Context(dry=args.dry_run, device=device, sizes=DRY if args.dry_run else GPU, tmp=tmp,
                  out=out, compile=args.compile)  # fmt: skip
    todo = [p for p in parts() if not args.only or p.key in args.only]
    result = {"check": "gpu_check", "dry_run": ctx.dry, "device": device_info(device),
              "commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
              timespec="seconds"), "pack_used": used,
              "sizes": dataclasses.asdict(ctx.sizes), "total_s": 0.0, "parts": {}}  # fmt: skip
    deadline = t_start + args.budget_s
    due = time.perf_counter()  # when the parts so far were due to end: unused time carries on
    try:
        for i, part in enumerate(todo, 1):
            due += part.budget_s
            limit = DRY_PART_S if ctx.dry else min(due, deadline) - time.perf_counter()
            print(f"== gpu_check {i}/{len(todo)} {part.key} (budget {limit:.0f} s)", flush=True)
            rec = run_part(part, ctx, limit_s=limit)
            print(f"   {rec['status']} in {rec['seconds']:.0f} s {rec.get('reason') or rec.get('error') or ''}",
                  flush=True)  # fmt: skip
            result["parts"][part.key] = rec
            result["total_s"] = round(time.perf_counter() - t_start, 1)
            _write(out, result)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # the trainer parts' world of one
            dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out / 'gpu_check.json'} and gpu_check.md ({result['total_s']:.0f} s)")
    bad = [k for k, p in result["parts"].items() if p["status"] in ("failed", "timeout")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
