"""Benchmark section "sharded_load": each rank's peak host memory while the student loads,
built on the meta device and filled shard by shard (the trainer's path), against building the
whole model on every rank and then sharding it (`models.build_model` then FSDP2).

Two ranks (FSDP2, gloo, fp32, CPU), fresh processes per case, on a ~0.5B random-init student
(`HALF_B`) and the pretrained SmolLM2-135M. A rank reports ``VmHWM`` (the trainer's
``load/host_peak_gib``) once sharded, its resident memory before the build and the bytes of its
own shards: the peak above base + shards is what the load held beyond what it must. The largest
over the ranks is kept. Goal: the peaks' ratio <= 0.6. ``python -m bench.training.sharded_load``
prints the section.
"""

from __future__ import annotations

import time

import torch
from torch.distributed.tensor import DTensor

from trainer.parallel.spawn import spawn

# the code these figures depend on (`bench.provenance.measured_paths`)
MEASURES = (
    "tokenbridge/models.py",
    "tokenbridge/model_init.py",
    "tokenbridge/safetensors_reads.py",
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


def _shard_gib(model: torch.nn.Module) -> float:
    """What this rank holds of the parameters once sharded (its local tensors), in GiB."""
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return sum(t.numel() * t.element_size() for t in local) / 2**30


def _load(rank: int, world: int, init: str, path: str) -> dict:
    """One rank: build the student one way or the other, FSDP2 over every rank."""
    start = _rss_gib("VmRSS")  # torch and the process group only
    import trainer.loop  # noqa: F401  (the trainer's imports: the same base in both paths)
    from tokenbridge import models
    from trainer.config.precision import Precision
    from trainer.config.sections import ModelConfig, ParallelConfig
    from trainer.parallel import parallelize, sharded_build
    from trainer.parallel.mesh import build_mesh

    # resident memory once the model is built on meta and parallelized, before any shard exists
    built = []
    fill = sharded_build.materialize

    def materialize(*args, **kwargs):
        built.append(_rss_gib("VmRSS"))
        return fill(*args, **kwargs)

    sharded_build.materialize = materialize

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
        model, _ = sharded_build.build_student(
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
        "start": start,
        "before": before,
        "peak": _rss_gib("VmHWM"),
        "built": built[0] if built else float("nan"),
        "shards": _shard_gib(model),
        "seconds": time.perf_counter() - t0,
    }


def measure(init: str, path: str) -> dict:
    ranks = spawn(_load, world_size=2, args=(init, path), timeout_s=1800.0)
    keys = ("start", "before", "built", "peak", "shards", "seconds")
    return {"params": ranks[0]["params"], **{k: max(r[k] for r in ranks) for k in keys}}


def _arithmetic(label: str, old: dict, new: dict) -> str:
    """The ratio against its floor: no load can hold less than the process's base plus its own
    shards, and the goal's ratio needs a base below what `base_needed` says."""
    base, shards, added = new["before"], new["shards"], old["peak"] - old["before"]
    floor = (base + shards) / old["peak"]
    # (b + shards) / (b + added) <= 0.6  <=>  b <= (0.6 * added - shards) / 0.4
    base_needed = (0.6 * added - shards) / 0.4
    return (
        f"- {label}: peak {new['peak'] / old['peak']:.2f}x the path before (goal <= 0.6x); "
        f"the floor, base {base:.2f} + own shards {shards:.2f} GiB with nothing else, is "
        f"{floor:.2f}x; what the load added {(new['peak'] - base) / added:.2f}x; 0.6x would "
        f"need a base <= {base_needed:.2f} GiB, where a rank holds {new['start']:.2f} GiB with "
        f"torch and its process group alone"
    )


def main() -> str:
    rows = [
        "| student | path | peak / rank (GiB) | before the load | meta built | own shards "
        "| peak above base + shards | load s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for label, init in CASES:
        old, new = measure(init, "whole"), measure(init, "meta")
        for name, r in (("whole model per rank, then FSDP2", old), ("meta, shards filled", new)):
            built = "-" if r["built"] != r["built"] else f"{r['built']:.2f}"  # NaN: no meta build
            rows.append(
                f"| {label} ({r['params'] / 1e9:.2f}B) | {name} | {r['peak']:.2f} | "
                f"{r['before']:.2f} | {built} | {r['shards']:.2f} | "
                f"{r['peak'] - r['before'] - r['shards']:.3f} | {r['seconds']:.1f} |"
            )
        ratios.append(_arithmetic(label, old, new))
    return "\n".join(
        [
            "## Sharded load (two ranks, FSDP2, CPU)",
            "",
            "Host memory each rank peaks at (VmHWM) once the student is built and sharded, "
            "largest over the 2 ranks; fresh processes per row, fp32 (bench/training/sharded_load.py). "
            "Before the load: the trainer's imports and the mesh; meta built: the model on the meta "
            "device with its plans applied, before any shard is allocated; own shards: the rank's "
            "local parameter tensors.",
            "",
            *rows,
            "",
            *ratios,
        ]
    )


if __name__ == "__main__":
    print(main())
