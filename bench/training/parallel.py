"""The student step under TP and CP on CPU (gloo): peak memory per rank and step time.

A step is what the trainer does for one microbatch and its update, through the trainer's own
verbs (`apply_tp`, `apply_cp`, `apply_fsdp`, the vocab-parallel CE), each case in fresh
processes against its one-process baseline.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import time

import torch

from bench.provenance import cpu_model
from trainer.parallel.spawn import spawn

TP = 3  # SmolLM2-135M: 9 heads, 3 K/V heads, MLP 1,536, vocabulary 49,152
TP_TOKENS = int(os.environ.get("TB_BENCH_TP_T", 2_048))  # smaller only for a smoke run
CP_TOKENS = int(os.environ.get("TB_BENCH_CP_T", 8_192))
STEPS = 2  # measured, after one warm-up
# narrow and deep: long-sequence activations, not weights, dominate
CP_MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": CP_TOKENS,
}


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident set


def _rank_main(rank: int, world_size: int, case: dict) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tokenbridge import models, paths
    from tokenbridge.dist_ops import global_count
    from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded
    from tokenbridge.losses import ce
    from trainer.config.schema import ModelConfig
    from trainer.data.microbatches import collate
    from trainer.parallel import parallelize
    from trainer.parallel.cp_attention import model_inputs
    from trainer.parallel.mesh import build_mesh

    tp, cp, tokens = case["tp"], case["cp"], case["tokens"]
    groups = build_mesh(torch.device("cpu"), dp=1, cp=cp, tp=tp)
    student = str(paths.student_dir())
    if case["random"]:
        cfg = ModelConfig(path=student, init="random", overrides=CP_MODEL)
    else:
        cfg = ModelConfig(path=student, init="pretrained")
    model = models.build_model(cfg)
    plan = parallelize.tp_plan(model.config.model_type) if tp > 1 else {}
    parallelize.apply_tp(model, groups.tp_mesh, plan)
    parallelize.apply_cp(model, cp)
    parallelize.apply_fsdp(model, groups.fsdp_mesh, mp_policy=MixedPrecisionPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 49_152, (tokens,), generator=torch.Generator().manual_seed(0))
    mb = collate(
        [{"student_ids": ids.numpy(), "text": "", "teachers": []}],
        student_pad=0,
        teacher_pads=[],
        pad_to_multiple=8,
    )
    rows = mb.student_rows(cp_size=cp, cp_rank=groups.cp_rank)
    targets = rows.targets_BL  # per-position CE: this rank's positions, no CPContext needed
    count = global_count((targets >= 0).sum(), dp_group=None, cp_group=groups.cp)
    kw = model_inputs(rows, group=groups.cp)
    found = {}

    def step() -> None:
        logits = model(**kw, use_cache=False).logits
        local, tp_group = unwrap_vocab_sharded(logits)
        found["logits_mib"] = local.numel() * local.element_size() / 2**20
        found["logits_shape"] = list(local.shape)
        out = ce(local, targets, vocab_size=49_152, tp_group=tp_group)
        (out.sum / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: AdamW state, allocator
    times, peaks = [], []
    for _ in range(STEPS):
        gc.collect()
        torch.distributed.barrier()
        _reset_peak()
        before = _status_mib("VmRSS")
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peaks.append(_status_mib("VmHWM") - before)
    return {"time": statistics.median(times), "peak_mib": max(peaks), **found}


def _case(**case) -> dict:
    world = case["tp"] * case["cp"]
    per_rank = spawn(_rank_main, world_size=world, args=(case,), timeout_s=3600.0)
    return {
        "time": max(r["time"] for r in per_rank),
        "peak_mib": max(r["peak_mib"] for r in per_rank),
        "logits_mib": per_rank[0]["logits_mib"],
        "logits_shape": per_rank[0]["logits_shape"],
    }


def _row(name: str, r: dict, base: dict) -> str:
    shape = " x ".join(f"{n:,}" for n in r["logits_shape"])
    return (
        f"| {name} | [{shape}], {r['logits_mib']:,.0f} MiB | {r['peak_mib']:,.0f} MiB "
        f"| {r['peak_mib'] / base['peak_mib']:.2f}x | {r['time']:.2f} s "
        f"| {r['time'] / base['time']:.2f}x |"
    )


def main() -> str:
    tp1 = _case(tp=1, cp=1, tokens=TP_TOKENS, random=False)
    tp2 = _case(tp=TP, cp=1, tokens=TP_TOKENS, random=False)
    cp1 = _case(tp=1, cp=1, tokens=CP_TOKENS, random=True)
    cp2 = _case(tp=1, cp=2, tokens=CP_TOKENS, random=True)
    head = [
        "| layout | logits per rank | step peak per rank | x baseline | step time | x baseline |",
        "|---|---|---:|---:|---:|---:|",
    ]
    m = CP_MODEL
    shape = (
        f"hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
        f"{m['num_attention_heads']} heads of {m['head_dim']} ({m['num_key_value_heads']} K/V "
        f"head), MLP {m['intermediate_size']}"
    )
    lines = [
        "## Student step under TP and CP (CPU, gloo; `bench/training/parallel.py`)",
        "",
        f"{cpu_model()}, {os.cpu_count()} cores. "
        "Forward + CE + backward + AdamW through the trainer's verbs, one torch thread per "
        f"process (tp = {TP} shares both cores, cp = 2 uses both, the baselines one). Peak = "
        "resident-set "
        "high-water mark during the step minus the resident set before it (activations, logits "
        "and their gradient, parameter gradients, FSDP buffers), max over ranks; weights and "
        f"AdamW state excluded. Median of {STEPS} steps after a warm-up. The machine is shared "
        "with other jobs: the step times are noisy, the ratios within this run are what counts.",
        "",
        f"**TP**: the demo student (SmolLM2-135M, pretrained), 1 x {TP_TOKENS:,} tokens; tp = "
        f"{TP} because its 9 attention heads (3 K/V heads) do not split over 2 ranks.",
        "",
        *head,
        _row("tp = 1 (baseline)", tp1, tp1),
        _row(f"tp = {TP}", tp2, tp1),
        "",
        f"**CP**: a narrow, deep random config ({shape}; vocabulary 49,152), 1 x "
        f"{CP_TOKENS:,} tokens.",
        "",
        *head,
        _row("cp = 1 (baseline)", cp1, cp1),
        _row("cp = 2", cp2, cp1),
        "",
        f"- TP: each rank's logits are {tp2['logits_mib'] / tp1['logits_mib']:.2f}x of the "
        f"whole [B, T, V] (vocab-sharded, never gathered); step peak "
        f"{tp2['peak_mib'] / tp1['peak_mib']:.2f}x; the time ratio is of {TP} processes on 2 "
        "cores.",
        f"- CP: activation memory per rank {cp2['peak_mib'] / cp1['peak_mib']:.2f}x of cp = 1 "
        "(goal <= 0.6x); step time "
        f"{cp2['time']:.1f} s vs {cp1['time']:.1f} s ({cp2['time'] / cp1['time']:.2f}x) on two "
        "cores vs one; gloo all-gathers K and V on CPU (no overlap with compute).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
