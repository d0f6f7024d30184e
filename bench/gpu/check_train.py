"""`make gpu-check`'s trainer parts: the demo pair, the 1B/4B shape, and one long row.

Each builds the real `Trainer` in this process (`trainer/main.py`'s path minus the command line)
and reads the step records a run would log, so the figures are the trainer's own; the shards are
the shipped corpus through the real projection of the two tokenizers.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from bench.common import ensure_projection, step_figures
from bench.gpu.check_cases import (
    Context,
    PeakMeter,
    cache_outputs,
    corpus_text,
    device_used_gib,
    median_s,
    random_model,
    teacher_rows,
    uninterrupted,
)
from tokenbridge import paths
from tokenbridge.alignment.text_shards import write_text_shards

TEACHER_SLACK = 1.25  # teacher tokens per window allowed over the student's (Gemma: ~1.0 here)


def pair_shards(ctx: Context, length: int) -> Path:
    """Shards of the corpus text cut to `length` student tokens (built once per length); the
    projection too."""
    key = f"shards{length}"
    if key not in ctx.cache:
        t0 = time.perf_counter()
        ensure_projection()
        ctx.cache[key] = write_text_shards(
            ctx.tmp / key, [("shakespeare", corpus_text(ctx))], student_dir=paths.student_dir(),
            teacher_dirs=[paths.teacher_dir()], max_tokens=length,
            max_teacher_tokens=int(length * TEACHER_SLACK), num_files=1,
        )  # fmt: skip
        print(f"   shards of {length} tokens: {time.perf_counter() - t0:.1f} s", flush=True)
    return ctx.cache[key]


def teacher_tokens_per_row(shards: Path) -> int:
    """The mean teacher window length of a shard directory, in tokens."""
    from tokenbridge.formats.shard_schema import teacher_ids_column
    from tokenbridge.formats.shards import open_shards

    windows = open_shards(shards).table()[teacher_ids_column(0)]
    return round(sum(len(w) for w in windows.to_pylist()) / len(windows))


def _set(prefix: str, d: dict) -> list[str]:
    """Hydra overrides setting each key of `d` under `prefix`, added where the composed config
    lacks it (``++``: conf/model/smollm2.yaml has no `overrides`; the tiny one has them all)."""
    return [f"++{prefix}.{k}={v}" for k, v in d.items()]


def overrides(
    ctx: Context,
    name: str,
    *,
    length: int,
    rows: int,
    teacher: bool,
    extra: list[str] = (),
    placement: str = "worker",
) -> list[str]:
    """The run's config: the demo experiment with random-init models (the debug one, tiny, in
    a dry run), shards at `length`, `rows` per microbatch, no eval, checkpoint or export, the
    precision by device (``auto``: bf16 and fused AdamW on a GPU); `teacher` False: the CE-only twin, else the
    teacher at `placement`."""
    shards = pair_shards(ctx, length)
    out = ["experiment=debug"] if ctx.dry else ["experiment=demo", "model.init=random"]
    out += [f"name={name}", f"run_dir={ctx.tmp / 'runs' / name}", f"data.shards={shards}",
            f"data.max_student_tokens={length}", f"data.micro_batch_size={rows}",
            "data.grad_accum=1", "data.eval_fraction=0.0", "data.shuffle_buffer=0", "steps=1000",
            "optim.warmup_steps=1", "eval.max_texts=0", "checkpoint.interval=0",
            "checkpoint.save_at_end=false", "checkpoint.export_at_end=false",
            "logging.progress=false", "logging.tensorboard=false", "logging.jsonl=false",
            f"device={ctx.device.type}", f"parallel.threads={0 if ctx.gpu else 1}"]  # fmt: skip
    out += ["parallel.param_dtype=auto", "optim.fused=auto"]
    if not teacher:
        return [*out, "loss=ce", "teachers=none", *extra]
    if not ctx.dry:
        out.append("teachers.0.init=random")
    out += ["teachers.0.dtype=auto", f"parallel.teacher_placement={placement}"]
    return [*out, *extra]


def trainer_steps(ctx: Context, args: list[str]) -> dict:
    """`warmup` + `steps` training steps of the Trainer the overrides `args` compose; the
    figures of the steps after the warm-up, the build's seconds and the first step's apart, the
    peaks of each step (whole, and forward + backward alone), the GPU memory in use by every
    process at the end (the teacher worker's included), and the student's parameter count."""
    from tokenbridge import models
    from trainer.config.compose import compose_config
    from trainer.loop import Trainer
    from trainer.preflight import preflight

    s = ctx.sizes
    meter = PeakMeter(ctx.device)
    meter.reset()
    cfg = compose_config(args)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, preflight(cfg, world_size=1))
    build_s = time.perf_counter() - t0
    # printed as they happen: a part cut at its budget still says where its time went
    print(f"   {cfg.name}: built in {build_s:.1f} s", flush=True)
    # each step's peaks, read before the reset that starts the next interval: forward +
    # backward alone just before the optimizer step (its states, allocated at its first step,
    # would hide what logits cost), the whole step just after it. The step records'
    # `memory_gib` is read after the reset, so it is not used here.
    fwd_bwd: list[float] = []
    whole: list[float] = []

    def after_step(*_):
        whole.append(meter.read())
        meter.reset()

    trainer.optimizer.register_step_pre_hook(lambda *_: fwd_bwd.append(meter.read()))
    trainer.optimizer.register_step_post_hook(after_step)
    try:
        records, times = [], []
        for i in range(s.warmup + s.steps):
            t0 = time.perf_counter()
            records.append(trainer.train_step(log=True))
            times.append(time.perf_counter() - t0)
            print(f"   {cfg.name}: step {i + 1} in {times[-1]:.2f} s", flush=True)
        n = len(records)
        if (len(fwd_bwd), len(whole), meter.resets) != (n, n, n + 1):
            raise RuntimeError(
                f"{n} steps: {len(fwd_bwd)} forward+backward peaks, {len(whole)} step peaks, "
                f"{meter.resets} resets (one optimizer step per training step expected)"
            )
        figures = step_figures(records, skip=s.warmup)
        figures["build_s"], figures["first_step_s"] = build_s, times[0]
        figures["memory_gib"] = max(whole[s.warmup :])
        figures["fwd_bwd_peak_gib"] = max(fwd_bwd[s.warmup :])
        figures["device_used_gib"] = device_used_gib(ctx.device)
        figures["student_params"] = models.num_params(trainer.model)
    finally:
        with uninterrupted():
            trainer.close()
            del trainer
            gc.collect()
            if ctx.gpu:
                torch.cuda.empty_cache()
    return figures


def teacher_alone_s(ctx: Context, *, rows: int, length: int) -> float:
    """Seconds of the demo teacher's forward alone on a microbatch of the run's shape (`rows` x
    `length` teacher tokens, top-32 outputs): its share of a step it shares the GPU with. (The
    worker's own ``teacher_s`` is its launch time on a GPU, not the GPU's.)"""
    from tokenbridge import models

    ids_BU, mask_BU = teacher_rows(ctx, rows=rows, length=length)
    forward = cache_outputs(models.freeze(random_model(ctx, "teacher", seed=2)))
    return median_s(lambda: forward(ids_BU, mask_BU), reps=ctx.sizes.reps, device=ctx.device)


def demo_pair(ctx: Context) -> dict:
    """Part 2: the distillation step (xtoken) with the teacher in its worker and in this
    process (on its own CUDA stream), and the CE-only student step on the same rows; the
    teacher's forward alone on such a microbatch. Two processes time-slice one GPU (no MPS: it
    is a daemon the device's owner starts, not this check), one process interleaves streams."""
    s = ctx.sizes
    run = lambda name, **kw: trainer_steps(  # noqa: E731
        ctx, overrides(ctx, name, length=s.demo_len, rows=s.demo_rows, **kw)
    )
    ce = run("demo_ce", teacher=False)
    kd = run("demo_kd", teacher=True)
    inproc = run("demo_kd_inprocess", teacher=True, placement="inprocess")
    t_len = teacher_tokens_per_row(pair_shards(ctx, s.demo_len))
    alone = teacher_alone_s(ctx, rows=s.demo_rows, length=t_len)
    return {
        "rows_per_step": s.demo_rows,
        "student_tokens_per_step": kd["tokens"],
        "student_tokens_per_s": kd["tokens_per_s"],
        "ce_only_tokens_per_s": ce["tokens_per_s"],
        "step_s": kd["step_s"],
        "ce_only_step_s": ce["step_s"],
        "distill_over_ce_step": kd["step_s"] / ce["step_s"],
        "inprocess_step_s": inproc["step_s"],
        "inprocess_over_ce_step": inproc["step_s"] / ce["step_s"],
        "inprocess_over_worker_step": inproc["step_s"] / kd["step_s"],
        "mfu_student": kd.get("mfu"),
        "student_model_tflops_per_s": kd.get("tflops_per_device"),
        "teacher_alone_s": alone,
        "teacher_share_of_step": alone / kd["step_s"],
        "peak_memory_gib": kd["memory_gib"],
        "fwd_bwd_peak_gib": kd["fwd_bwd_peak_gib"],
        "inprocess_peak_memory_gib": inproc["memory_gib"],
        "ce_only_peak_memory_gib": ce["memory_gib"],
        "device_used_gib": kd["device_used_gib"],
        "build_s": kd["build_s"],
        "mps": "not run (a daemon the device's owner starts; this check changes no device setting)",
    }


def scale_1b_4b(ctx: Context) -> dict:
    """Part 3: the ~1.2B student from the ~3.9B teacher at `scale_len`, activation
    checkpointing on every student block (and compile with ``--compile``)."""
    s = ctx.sizes
    extra = [
        *_set("model.overrides", s.student_1b),
        *_set("teachers.0.overrides", s.teacher_4b),
        "parallel.activation_checkpointing=full",
    ]
    if ctx.compile:
        extra.append("parallel.compile=true")
    # the dry run keeps this teacher in process: part 2 tried the worker, and a start costs it
    # seconds (a GPU run has the 3.9B teacher in its worker, as a real run would)
    placement = "inprocess" if ctx.dry else "worker"
    args = overrides(ctx, "scale", length=s.scale_len, rows=s.scale_rows, teacher=True,
                     extra=extra, placement=placement)  # fmt: skip
    r = trainer_steps(ctx, args)
    return {
        "build_s": r["build_s"],
        "first_step_s": r["first_step_s"],
        "student_params_b": r["student_params"] / 1e9,
        "rows_per_step": s.scale_rows,
        "student_tokens_per_step": r["tokens"],
        "student_tokens_per_s": r["tokens_per_s"],
        "step_s": r["step_s"],
        "peak_memory_gib": r["memory_gib"],
        "fwd_bwd_peak_gib": r["fwd_bwd_peak_gib"],
        "device_used_gib": r["device_used_gib"],
        # the run's own figures (trainer.throughput; no MFU where no peak is known, e.g. CPU)
        "student_model_tflops_per_s": r.get("tflops_per_device"),
        "mfu_student": r.get("mfu"),
        "teacher_model_tflops_per_s": r.get("teacher_tflops_per_device"),
        "mfu_teacher": r.get("teacher_mfu"),
    }


def long_row(ctx: Context) -> dict:
    """Part 4: CE on one `long_len`-token row, the ~1.2B student with activation
    checkpointing: the lm_head in chunks of `logits_chunk` positions, then whole logits (0)."""
    s = ctx.sizes
    base = [*_set("model.overrides", s.student_1b), "parallel.activation_checkpointing=full"]
    out: dict = {"row_tokens": s.long_len, "logits_chunk": s.logits_chunk}
    for name, chunk in (("chunked", s.logits_chunk), ("whole", 0)):
        extra = [*base, f"parallel.logits_chunk={chunk}"]
        args = overrides(ctx, f"long_{name}", length=s.long_len, rows=1, teacher=False, extra=extra)
        try:
            r = trainer_steps(ctx, args)
        except torch.OutOfMemoryError:
            out[f"{name}_logits"] = "out of memory"
            continue
        out[f"{name}_peak_memory_gib"] = r["memory_gib"]
        out[f"{name}_fwd_bwd_peak_gib"] = r["fwd_bwd_peak_gib"]
        out[f"{name}_step_s"] = r["step_s"]
    return out
