"""Non-finite steps through the real loop, run by tests/e2e/test_nonfinite.py in ONE process
(a script, not a test module): ``python -m tests.e2e.nonfinite_cases SHARDS OUT``.

Tiny random-init student and kd_topk teacher on the real SmolLM2 tokenizer, world size 1, the
teacher in-process. Nothing in the product is patched: a forward hook on the student makes its
logits NaN in one step (standing in for an overflow). The findings go to OUT (JSON):

- ``stop``: NaN logits in step 3 with checkpoints every step: the error message;
- ``skip``: the same with ``optim.skip_nonfinite``: per-step losses and parameter checksums
  (the skipped step changes no parameter, the next ones train on), the skipped count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist.test_trainer_cases import TINY, params_checksum
from tokenbridge import paths
from trainer.config.schema import from_dictconfig
from trainer.loop import Trainer
from trainer.preflight import preflight
from trainer.run_log import NonFiniteError

NAN_STEP = 3


def make_trainer(shards: str, run_dir: Path, *, teacher: dict, **top) -> Trainer:
    student = str(paths.student_dir())
    cfg = from_dictconfig(
        {
            "name": "nonfinite",
            "run_dir": str(run_dir),
            "steps": 5,
            "device": "cpu",
            "model": {"path": student, "init": "random", "seed": 1, "overrides": TINY},
            "teachers": [{"name": "t", **teacher}],
            "loss": {"mode": "kd_topk", "options": {"k": 8}, "ce_weight": 1.0, "kd_weight": 0.5},
            "data": {
                "shards": shards,
                "micro_batch_size": 1,
                "grad_accum": 2,
                "shuffle_buffer": 0,
                "max_student_tokens": 64,
                "eval_fraction": 0.0,
            },  # fmt: skip
            "optim": {"lr": 1e-2, "warmup_steps": 0},
            "parallel": {"teacher_placement": "inprocess"},
            "checkpoint": {"interval": 1, "keep": 5, "export_at_end": False},
            "eval": {"max_texts": 0},
            "logging": {"tensorboard": False, "progress": False, "report": False},
            **top,
        }
    )
    return Trainer(cfg, preflight(cfg, world_size=1))


def nan_logits_in_step(t: Trainer, step: int) -> None:
    """NaN student logits in every forward of optimizer step `step` (1-based): the final
    norm's output, the lm_head's input, is made NaN (the logits are never whole by default)."""

    def hook(_module, _args, out):
        return out * float("nan") if t.step == step - 1 else out

    t.model.model.norm.register_forward_hook(hook)


def case_stop(shards: str, tmp: Path) -> dict:
    t = make_trainer(shards, tmp / "stop", teacher=RANDOM_TEACHER)
    nan_logits_in_step(t, NAN_STEP)
    try:
        t.train()
        return {"error": None}
    except NonFiniteError as e:
        return {"error": str(e), "step": t.step}
    finally:
        t.close()


def case_skip(shards: str, tmp: Path) -> dict:
    t = make_trainer(shards, tmp / "skip", teacher=RANDOM_TEACHER, optim={
        "lr": 1e-2, "warmup_steps": 0, "skip_nonfinite": True})  # fmt: skip
    nan_logits_in_step(t, NAN_STEP)
    try:
        losses, checksums = [], []
        for _ in range(5):
            losses.append(t.train_step()["loss"])
            checksums.append(params_checksum(t.model))
        return {"losses": losses, "checksums": checksums, "skipped": t.skipped_steps}
    finally:
        t.close()


RANDOM_TEACHER = {"path": str(paths.student_dir()), "init": "random", "seed": 2, "overrides": TINY}


def main(shards: str, out: str) -> None:
    tmp = Path(out).parent / "runs"
    torch.set_num_threads(1)
    result = {
        "stop": case_stop(shards, tmp),
        "skip": case_skip(shards, tmp),
    }
    Path(out).write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
