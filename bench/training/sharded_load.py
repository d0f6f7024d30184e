"""Benchmark section "sharded_load": each rank's peak host memory while the student loads,
built on the meta device and filled shard by shard (the trainer's path), against building the
whole model on every rank and then sharding it (`models.build_model` then FSDP2).

Two ranks (FSDP2, gloo, fp32, CPU), fresh processes per case, on a ~0.5B random-init student
(`HALF_B`) and the pretrained SmolLM2-135M. A rank reports ``VmHWM`` (the trainer's
``load/host_peak_gib``) once sharded, and its resident memory before the build; the largest
over the ranks is kept. Goal: the peaks' ratio <= 0.6. ``python -m bench.training.sharded_load``
prints the section.
"""

from __future__ import annotations

import time

import torch

from trainer.parallel.spawn import spawn

# the code these figures depend on (`bench.provenance.measured_paths`)
MEASURES = (
    "tokenbridge/models.py",
    "tokenbridge/model_init.py",
    "tokenbridge/weight_slices.py",
    "trainer/parallel",
    "bench/training/sharded_load.py",
)
STUDENT = "artifacts/models/smollm2-135m"
# ~0.49B parameters: SmolLM2's 49,152-token vocabulary, tied, width 1,024, 28 blocks
HALF_B = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
CASES = (("random ~0.5B", "random"), ("pretrained SmolLM2-135M", "pretrained"))


def _rss_gib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _load(rank: int, world: int, init: str, path: str) -> dict:
    """One rank: build the student one way or the other, FSDP2 over every rank."""
    import trainer.loop  # noqa: F401  (the trainer's imports: the same base in both paths)
    from tokenbridge import models
    from trainer.config.precision import Precision
    from trainer.config.sections import ModelConfig, ParallelConfig
    from trainer.parallel import parallelize
    from trainer.parallel.mesh import build_mesh
    from trainer.parallel.sharded_build import build_student

    cfg = ModelConfig(path=STUDENT, init=init, overrides=HALF_B if init == "random" else {})
    mesh = build_mesh(torch.device("cpu"), dp=world)
    before, t0 = _rss_gib("VmRSS"), time.perf_counter()
    if path == "meta":
        precision = Precision(
            device="cpu",
            param_dtype="float32",
            reduce_dtype="float32",
            teacher_dtypes=(),
            fused_optimizer=True,
        )
        model, _ = build_student(
            cfg,
            mesh=mesh,
            parallel=ParallelConfig(),
            precision=precision,
            device=torch.device("cpu"),
        )
    else:  # the path before: every rank builds the whole model, then FSDP2 shards it
        model = models.build_model(cfg)
        model.train()
        mp = torch.distributed.fsdp.MixedPrecisionPolicy()
        parallelize.apply_fsdp(model, mesh.fsdp_mesh, mp_policy=mp)
    return {
        "params": models.num_params(model),
        "before": before,
        "peak": _rss_gib("VmHWM"),
        "seconds": time.perf_counter() - t0,
    }


def measure(init: str, path: str) -> dict:
    ranks = spawn(_load, world_size=2, args=(init, path), timeout_s=1800.0)
    return {
        "params": ranks[0]["params"],
        "before": max(r["before"] for r in ranks),
        "peak": max(r["peak"] for r in ranks),
        "seconds": max(r["seconds"] for r in ranks),
    }


def main() -> str:
    rows = [
        "| student | path | peak / rank (GiB) | before the load | added by the load | load s |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for label, init in CASES:
        old, new = measure(init, "whole"), measure(init, "meta")
        for name, r in (("whole model per rank, then FSDP2", old), ("meta, shards filled", new)):
            rows.append(
                f"| {label} ({r['params'] / 1e9:.2f}B) | {name} | {r['peak']:.2f} | "
                f"{r['before']:.2f} | {r['peak'] - r['before']:.2f} | {r['seconds']:.1f} |"
            )
        added = (new["peak"] - new["before"]) / (old["peak"] - old["before"])
        # what a perfect half would give: the base process plus half of what the load added
        floor = (old["before"] + (old["peak"] - old["before"]) / 2) / old["peak"]
        ratios.append(
            f"- {label}: peak {new['peak'] / old['peak']:.2f}x the path before (goal <= 0.6x; "
            f"half the load's memory on top of the same base would be {floor:.2f}x); what the "
            f"load added {added:.2f}x"
        )
    return "\n".join(
        [
            "## Sharded load (two ranks, FSDP2, CPU)",
            "",
            "Host memory each rank peaks at (VmHWM) once the student is built and sharded, "
            "largest over the 2 ranks; fresh processes per row, fp32 (bench/training/sharded_load.py).",
            "",
            *rows,
            "",
            *ratios,
        ]
    )


if __name__ == "__main__":
    print(main())
