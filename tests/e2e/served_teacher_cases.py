"""A teacher served by vLLM vs the same teacher in process, run by
tests/e2e/test_served_teacher.py in ONE process (a script, not a test module):
``python -m tests.e2e.served_teacher_cases SHARDS TEACHER_DIR PROJECTION URL MODEL OUT``.

The server (started by the test's session fixture as `make teacher-server` starts it) serves
TEACHER_DIR, a tiny random-init Llama saved with the SmolLM2 tokenizer; the live runs load the
same directory (init pretrained). Findings go to OUT (JSON):

- ``kd_topk`` / ``xtoken`` (identity projection, with the chain term): per-step metrics of the
  live teacher and of the served one, same rows, same seeds;
- ``refused``: the preflight's message for a server that must not be used (another model name,
  k above its max_logprobs, another tokenizer) and the config's for gold / temperature != 1;
- ``killed``: the error a run meets once its server is killed (run last: it ends the server).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import torch

from tests.dist.test_trainer_cases import TINY
from tokenbridge import paths
from tokenbridge.commands import teacher_server
from tokenbridge.tokenizers import load_tokenizer
from trainer.config.schema import TeacherConfig, from_dictconfig
from trainer.loop import Trainer
from trainer.preflight import preflight
from trainer.teacher.served_teacher import open_served

STEPS = 3


def make_cfg(shards: str, run_dir: Path, *, teacher: dict, loss: dict, **top):
    d = {
        "name": "served",
        "run_dir": str(run_dir),
        "steps": STEPS,
        "seed": 0,
        "device": "cpu",
        "model": {"path": str(paths.student_dir()), "init": "random", "seed": 1, "overrides": TINY},
        "teachers": [teacher],
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
        "parallel": {"teacher_placement": "inprocess"},
        "checkpoint": {"resume": "none", "save_at_end": False, "export_at_end": False},
        "eval": {"max_texts": 0},
        "logging": {"jsonl": False, "tensorboard": False, "progress": False},
    }
    return from_dictconfig({**d, **top})


def train(cfg, steps: int = STEPS) -> list[dict]:
    t = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        return [t.train_step() for _ in range(steps)]
    finally:
        t.close()


def refusal(make) -> str | None:
    try:
        cfg = make()
        preflight(cfg, world_size=1)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"{type(e).__name__}: {e}"
    return None


def main(shards: str, teacher_dir: str, projection: str, url: str, model: str, out: str) -> None:
    tmp = Path(out).parent / "runs"
    torch.set_num_threads(1)
    live = {"path": teacher_dir, "name": "t"}
    served = {**live, "server": url, "served_model": model, "server_timeout_s": 5.0}
    losses = {
        "kd_topk": {"mode": "kd_topk", "options": {"k": 8}},
        "xtoken": {"mode": "xtoken", "options": {"k": 8, "chain_weight": 0.5}},
    }
    result: dict = {}
    for name, loss in losses.items():
        extra = {"projection": projection} if name == "xtoken" else {}
        result[name] = {
            "live": train(
                make_cfg(shards, tmp / f"{name}_live", teacher={**live, **extra}, loss=loss)
            ),  # fmt: skip
            "served": train(
                make_cfg(shards, tmp / f"{name}_served", teacher={**served, **extra}, loss=loss)
            ),  # fmt: skip
        }
    kd = losses["kd_topk"]
    result["refused"] = {
        "ok": refusal(lambda: make_cfg(shards, tmp / "r", teacher=served, loss=kd)),
        "model": refusal(
            lambda: make_cfg(
                shards, tmp / "r", loss=kd, teacher={**served, "served_model": "other"}
            )
        ),  # fmt: skip
        "k": refusal(
            lambda: make_cfg(
                shards, tmp / "r", teacher=served, loss={"mode": "kd_topk", "options": {"k": 16}}
            )
        ),  # fmt: skip
        "tokenizer": refusal(
            lambda: open_served(  # the Gemma tokenizer against this server
                TeacherConfig(path=str(paths.teacher_dir()), server=url, served_model=model),
                index=0,
                tokenizer=load_tokenizer(paths.teacher_dir()),
                k=8,
                max_len=64,
            )
        ),  # fmt: skip
        "gold": refusal(
            lambda: make_cfg(
                shards,
                tmp / "r",
                loss={"mode": "gold"},
                teacher={**served, "projection": projection},
            )
        ),  # fmt: skip
        "temperature": refusal(
            lambda: make_cfg(shards, tmp / "r", teacher=served, loss={**kd, "temperature": 2.0})
        ),  # fmt: skip
    }
    # last: the server is killed (SIGKILL, as a lost node) and the run must stop naming it
    cfg = make_cfg(shards, tmp / "killed", teacher=served, loss=kd)
    t = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        first = t.train_step()
        port = int(url.rsplit(":", 1)[1])
        teacher_server.stop(port, sig=signal.SIGKILL)
        try:
            for _ in range(STEPS):
                t.train_step()
            result["killed"] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the message is the finding
            result["killed"] = {"error": f"{type(e).__name__}: {e}", "first": first}
    finally:
        t.close()
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:7])
