"""Multi-process cases for the trainer, run by tests/dist/test_trainer.py in ONE 2-rank torchrun
(a script, not a test module: it defines no test functions).

``python -m torch.distributed.run --nproc_per_node=2 tests/dist/test_trainer_cases.py SHARDS OUT
PROJECTION``
builds real `Trainer`s (tiny random-init SmolLM2-tokenizer student and kd_topk teacher, gloo)
one after another in the same process group and writes rank 0's findings to OUT (JSON):

- ``layouts``: per-step losses and the final parameters' checksum of layouts that see the same
  global batch: dp=2 x 1 row x 2 microbatches, tp=2 x 2 rows x 2 microbatches, tp=2 x 1 row x 4
  microbatches, dp=2 with the teacher tensor-parallel over both ranks, and cp=2 with activation
  checkpointing of every other block (the loss and the update must not depend on the layout,
  the split, the teacher's sharding or recomputing activations);
- ``resume``: losses of steps 3-4 of an uninterrupted dp=2 run, and of a run stopped after step 2
  (stop_after), checkpointed, and resumed by a fresh Trainer;
- ``modes``: two steps of xtoken (with the chain term), alm and gold (metrics per step);
- ``clip``: the global gradient norm of `parallelize.clip_grad_norm_` on a TP+FSDP model vs the
  norm of the same gradients on an unsharded copy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# run as a script (torchrun): import this checkout's packages, not an installed copy's
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.distributed as dist

from tokenbridge import paths
from trainer.config.schema import from_dictconfig
from trainer.loop import Trainer
from trainer.parallel import parallelize
from trainer.preflight import preflight

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def make_cfg(
    shards: str,
    run_dir: str,
    *,
    dp: int,
    tp: int,
    mb: int,
    accum: int,
    teacher_tp: int = 1,
    loss: dict | None = None,
    projection: str | None = None,
    cp: int = 1,
    ac: str = "none",
    data: dict | None = None,
    **top,
):
    student = str(paths.student_dir())
    d = {
        "name": "dist",
        "run_dir": run_dir,
        "steps": 4,
        "seed": 0,
        "device": "cpu",
        "model": {"path": student, "init": "random", "seed": 1, "overrides": TINY},
        "teachers": [
            {
                "path": student,
                "init": "random",
                "seed": 2,
                "name": "t",
                "overrides": TINY,
                "tp": teacher_tp,
                "projection": projection,
            }
        ],
        "loss": loss
        or {"mode": "kd_topk", "options": {"k": 8}, "ce_weight": 1.0, "kd_weight": 0.5},
        "data": {
            "shards": shards,
            "micro_batch_size": mb,
            "grad_accum": accum,
            "shuffle_buffer": 0,  # file order: every layout sees the same global batch
            "max_student_tokens": 64,
            "eval_fraction": 0.0,
            **(data or {}),
        },
        "optim": {"lr": 1e-2, "warmup_steps": 0, "grad_clip": 1.0},
        "parallel": {
            "dp_shard": dp,
            "tp": tp,
            "cp": cp,
            "activation_checkpointing": ac,
            "teacher_placement": "inprocess",
        },
        "checkpoint": {"resume": "none", "save_at_end": False, "export_at_end": False},
        "eval": {"max_texts": 0},
        "logging": {"jsonl": False, "tensorboard": False, "progress": False, "report": False},
        **top,
    }
    return from_dictconfig(d)


def params_checksum(model) -> float:
    """Sum of |param| over the whole (unsharded) model: equal updates give equal sums."""
    total = 0.0
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        total += float(full.detach().double().abs().sum())
    return total


def run_steps(cfg, n: int) -> tuple[Trainer, list[float]]:
    t = Trainer(cfg, preflight(cfg, world_size=dist.get_world_size()))
    losses = [t.train_step()["loss"] for _ in range(n)]
    return t, losses


def case_layouts(shards: str, tmp: Path) -> dict:
    out = {}
    for name, kw in {
        "dp2_mb1_x2": {"dp": 2, "tp": 1, "mb": 1, "accum": 2},
        "tp2_mb2_x2": {"dp": 1, "tp": 2, "mb": 2, "accum": 2},
        "tp2_mb1_x4": {"dp": 1, "tp": 2, "mb": 1, "accum": 4},
        # the teacher sharded on its own mesh, serving two dp ranks with different microbatches
        "dp2_teacher_tp2": {"dp": 2, "tp": 1, "mb": 1, "accum": 2, "teacher_tp": 2},
        # activation checkpointing of block 0 of 2 under CP: the recompute in the backward
        # gathers K and V over cp again, and FSDP shards a wrapped and a plain block
        "cp2_ac_every_n": {"dp": 1, "tp": 1, "cp": 2, "mb": 2, "accum": 2, "ac": "every_n"},
    }.items():
        t, losses = run_steps(make_cfg(shards, str(tmp / name), **kw), 2)
        out[name] = {"losses": losses, "checksum": params_checksum(t.model)}
        t.close()
    return out


def case_packing(shards: str, tmp: Path) -> dict:
    """Packed rows through the loop (data.packing, the in-process teacher program with position
    ids): two windows per row (pack_buffer=2), so each step holds the same windows as the
    layouts' base, dp2_mb1_x2 (rank r's stream, two at a time); once at dp=2, once at tp=2 with
    the teacher sharded on its own mesh (its inputs, position ids included, all-gathered)."""
    packing = {"packing": True, "packed_tokens": 128, "pack_buffer": 2}
    out = {}
    for name, kw in {
        "dp2_packed": {"dp": 2, "tp": 1, "mb": 1, "accum": 1},
        "tp2_packed_teacher_tp2": {"dp": 1, "tp": 2, "mb": 1, "accum": 2, "teacher_tp": 2},
    }.items():
        cfg = make_cfg(shards, str(tmp / name), data=packing, **kw)
        t = Trainer(cfg, preflight(cfg, world_size=dist.get_world_size()))
        steps = [t.train_step() for _ in range(2)]
        out[name] = {
            "losses": [m["loss"] for m in steps],
            "checksum": params_checksum(t.model),
            "records": steps,
        }
        t.close()
    return out


def case_resume(shards: str, tmp: Path) -> dict:
    kw = {"dp": 2, "tp": 1, "mb": 1, "accum": 2}
    full, losses = run_steps(make_cfg(shards, str(tmp / "full"), **kw), 4)
    full.close()
    run_dir = str(tmp / "stopped")
    ck = {"resume": "auto", "save_at_end": True, "export_at_end": False}
    first = Trainer(
        cfg := make_cfg(shards, run_dir, stop_after=2, checkpoint=ck, **kw),
        preflight(cfg, world_size=2),
    )
    first.train()
    first.close()
    second = Trainer(
        cfg2 := make_cfg(shards, run_dir, checkpoint=ck, **kw), preflight(cfg2, world_size=2)
    )
    resumed_at = second.step
    resumed = [second.train_step()["loss"] for _ in range(2)]
    second.close()
    return {"uninterrupted": losses[2:], "resumed": resumed, "resumed_at": resumed_at}


def case_modes(shards: str, tmp: Path, projection: str) -> dict:
    """Every cross-tokenizer mode through the loop (here on a same-tokenizer pair with its real,
    identity-like projection): finite terms, and the loop's own check that each mode's count,
    taken from the batch before the forward, equals the count the loss returns."""
    out = {}
    for mode, options in (("xtoken", {"k": 8, "chain_weight": 0.5}), ("alm", {}), ("gold", {})):
        loss = {"mode": mode, "options": options, "ce_weight": 1.0, "kd_weight": 1.0}
        kw = {"dp": 2, "tp": 1, "mb": 1, "accum": 2, "loss": loss, "projection": projection}
        t = Trainer(cfg := make_cfg(shards, str(tmp / mode), **kw), preflight(cfg, world_size=2))
        out[mode] = [t.train_step() for _ in range(2)]
        t.close()
    return out


def case_clip() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainer.parallel.mesh import build_mesh

    hf = LlamaConfig(vocab_size=300, tie_word_embeddings=True, **TINY)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(hf)
    model = AutoModelForCausalLM.from_config(hf)
    model.load_state_dict(ref.state_dict())
    groups = build_mesh(torch.device("cpu"), dp=1, tp=2)
    parallelize.apply_tp(model, groups.tp_mesh, parallelize.tp_plan("llama"))
    parallelize.apply_fsdp(model, groups.fsdp_mesh, mp_policy=MixedPrecisionPolicy())
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids).logits.square().mean().backward()
    ref(input_ids=ids).logits.square().mean().backward()
    norm = parallelize.clip_grad_norm_(list(model.parameters()), 0.0)
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    return {"sharded": float(norm), "reference": float(want)}


def main(shards: str, out: str, projection: str) -> None:
    tmp = Path(out).parent / "runs"
    torch.set_num_threads(1)
    parallelize.init_distributed(torch.device("cpu"))
    result = {
        "layouts": case_layouts(shards, tmp),
        "resume": case_resume(shards, tmp),
        "clip": case_clip(),
        "packing": case_packing(shards, tmp),
        "modes": case_modes(shards, tmp, projection),
    }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
