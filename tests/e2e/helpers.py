"""Test inputs the benchmarks do not need (those both use: `bench.common`, and shards from
texts: `tokenbridge.alignment.text_shards`).

`identity_projection` maps a tokenizer onto itself; `tiny_config` is the one-process run of the
case scripts (a tiny random-init student on the SmolLM2 tokenizer); `example_rows` (the shipped example
conversations) and `write_chat_shards` (a conversation shard directory, by the align job's pure
steps, without Beam) live in `bench.common`, which the packing bench shares; re-exported here.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.common import example_rows, write_chat_shards  # noqa: F401 (re-exported)
from tokenbridge import paths, projection
from tokenbridge.tokenizers import load_tokenizer

REPO = paths.REPO_ROOT


def identity_projection(tokenizer_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """A k=2 projection of a tokenizer onto itself (rows padded to 49152), saved at ``out``."""
    tok = load_tokenizer(tokenizer_dir)
    return projection.save_projection(
        projection.build_projection(tok, tok, k=2, teacher_rows=49152, student_rows=49152), out
    )


def tiny_config(
    shards: str, run_dir: Path, *, name: str, steps: int, teachers: list[dict], loss: dict,
    placement: str = "inprocess", **top,
):  # fmt: skip
    """The case scripts' run (`trainer.config.schema.TrainConfig`): the tiny student of
    tests/dist/test_trainer_cases.py, 2 x 2 rows of 64 tokens a step, nothing saved, no eval,
    no logs; `top` replaces whole top-level sections."""
    from tests.dist.test_trainer_cases import TINY
    from trainer.config.schema import from_dictconfig

    d = {
        "name": name,
        "run_dir": str(run_dir),
        "steps": steps,
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(paths.student_dir()), "init": "random", "seed": 1, "overrides": TINY},
        "teachers": teachers,
        "loss": loss,
        "data": {
            "shards": shards,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "shuffle_buffer": 8,
            "max_student_tokens": 64,
            "eval_fraction": 0.0,
        },  # fmt: skip
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "parallel": {"teacher_placement": placement},
        "checkpoint": {"resume": "none", "save_at_end": False, "export_at_end": False},
        "eval": {"max_texts": 0},
        "logging": {"jsonl": False, "tensorboard": False, "progress": False, "report": False},
    }
    return from_dictconfig({**d, **top})
