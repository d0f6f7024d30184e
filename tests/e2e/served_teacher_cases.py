"""A teacher served by vLLM vs the same teacher in process, run by
tests/e2e/test_served_teacher.py in ONE process (a script, not a test module):
``python -m tests.e2e.served_teacher_cases SHARDS TEACHER_DIR PROJECTION URL MODEL PORT OUT
CROSS_SHARDS`` (CROSS_SHARDS: aligned for a Gemma-tokenizer student and two teachers).

The server (started by the test's session fixture as `make teacher-server` starts it) serves
TEACHER_DIR, a tiny random-init Llama saved with the SmolLM2 tokenizer; the live runs load the
same directory. Every run has three teachers on it, one per mode a server serves (kd_topk,
xtoken with the identity projection, alm: top-k, tail and realised-token log-probs), so one
live run and one served run compare them all. Findings go to OUT (JSON):

- ``refused``: per case, the stage that refused (config / preflight; a Trainer, which builds the
  models, is never reached) and its message: another model name, k above max_logprobs,
  another tokenizer, gold, temperature != 1;
- ``live`` / ``served``: per-step metrics, same rows, same seeds;
- ``onpolicy``: per-step metrics of an on-policy run (lag 1, the three teachers scoring each
  rollout in opd_pg, xtoken and alm), with the teachers in process and served: same seeds; and
  (``cross_*``) of one whose student has Gemma's tokenizer, two teachers in opd_pg and alm, so
  the rollouts are re-tokenized and aligned for the served teacher on the fly;
- ``fault``: a served run (`Trainer.train`, a checkpoint every step) whose server is killed
  (SIGKILL) after its first checkpoint: exit code and line as `trainer/main.py` reports them,
  the checkpoints left and whether the last verifies; then, the server restarted on its port,
  the resumed run's step and losses (to equal ``served``'s within 1e-5).
"""

from __future__ import annotations

import contextlib
import io
import json
import signal
import sys
from pathlib import Path

import torch

from tests.e2e.helpers import tiny_config
from tests.tiny import SERVED_K
from tokenbridge import cli, paths
from tokenbridge.commands import teacher_server
from tokenbridge.tokenizers import load_tokenizer
from trainer import main as train_main
from trainer.checkpoint import checkpointer
from trainer.config.schema import TeacherConfig
from trainer.loop import Trainer
from trainer.preflight import preflight
from trainer.teacher.served_teacher import open_served

STEPS = 3
TIMEOUT_S = 20.0  # a busy machine's slow answer is no fault; a dead server fails after this
# the killed-server run waits this long for its dead server (the tiny teacher answers in well
# under a second; the other runs keep the roomier TIMEOUT_S)
FAULT_TIMEOUT_S = 8.0
MODES = ("kd_topk", "xtoken", "alm")  # teacher i's mode; loss.options stay {} (shared by all)


def make_cfg(shards: str, run_dir: Path, *, teachers: list[dict], loss: dict | None = None, **top):
    return tiny_config(shards, run_dir, name="served", steps=STEPS, teachers=teachers,
                       loss=loss or {"mode": MODES[0]}, **top)  # fmt: skip


def train(cfg, steps: int = STEPS) -> list[dict]:
    t = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        return [t.train_step() for _ in range(steps)]
    finally:
        t.close()


def refusal(make, check=lambda cfg: preflight(cfg, world_size=1)) -> dict:
    """Where a config is refused: building it (config rules) or the preflight (`check`); a
    Trainer, which builds the models, is never reached."""
    stage = "config"
    try:
        cfg = make()
        stage = "preflight"
        check(cfg)
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return {"stage": stage, "error": f"{type(e).__name__}: {e}"}
    return {"stage": None, "error": None}


def refusals(shards: str, teachers: list[dict], projection: str) -> dict:
    """Each case as the run's three teachers (the shards have three), changed where it says."""
    kd = [
        {k: v for k, v in {**t, "loss": "kd_topk"}.items() if k != "projection"} for t in teachers
    ]
    gold = [{**t, "loss": "gold", "projection": projection} for t in teachers]
    other = [{**t, "served_model": "other"} for t in kd]
    return {
        "ok": refusal(lambda: make_cfg(shards, Path("unused"), teachers=teachers)),
        "model": refusal(lambda: make_cfg(shards, Path("unused"), teachers=other)),
        "k": refusal(lambda: make_cfg(
            shards, Path("unused"), teachers=kd, loss={"mode": "kd_topk", "options": {"k": SERVED_K + 1}})),
        # the preflight's server check with the Gemma tokenizer (shards of Gemma ids would be
        # refused before it, by their own tokenizer check)
        "tokenizer": refusal(
            lambda: TeacherConfig(path=str(paths.teacher_dir()), server=kd[0]["server"],
                                  served_model=kd[0]["served_model"]),
            lambda t: open_served(t, index=0, tokenizer=load_tokenizer(t.path), k=8, max_len=64)),
        "gold": refusal(lambda: make_cfg(
            shards, Path("unused"), teachers=gold, loss={"mode": "gold"})),
        "temperature": refusal(lambda: make_cfg(
            shards, Path("unused"), teachers=kd, loss={"mode": "kd_topk", "temperature": 2.0})),
    }  # fmt: skip


ONPOLICY_MODES = ("opd_pg", "xtoken", "alm")  # teacher i's on-policy mode


CROSS_MODES = ("opd_pg", "alm")  # the modes that need no projection, for another tokenizer


def onpolicy_run(cfg_of, modes=ONPOLICY_MODES, steps: int = STEPS) -> list[dict]:
    """An on-policy run of ``steps`` steps (lag 1: the next rollouts are scored while the
    student learns), stepped as `Trainer.train` steps it."""
    cfg = cfg_of(
        loss={"mode": "ce"},
        onpolicy={"enabled": True, "teacher_losses": list(modes), "lag": 1,
                  "prompt_tokens": 8, "max_new_tokens": 12, "prompts_per_step": 2,
                  "n_samples": 2, "micro_batch_size": 2, "eval_prompts": 0},
    )  # fmt: skip
    t = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        return [t.onpolicy.step(log=True, last=i == steps - 1) for i in range(steps)]
    finally:
        t.close()


def fault(cfg_of, *, teacher_dir: str, name: str, port: int) -> dict:
    """The served run killed after its first checkpoint, then resumed on a restarted server."""
    cfg = cfg_of(
        checkpoint={"interval": 1, "keep": 4, "resume": "auto", "save_at_end": False,
                    "export_at_end": False},
        logging={"jsonl": True, "tensorboard": False, "progress": False, "report": False},
    )  # fmt: skip
    t = Trainer(cfg, preflight(cfg, world_size=1))
    save = t.save_checkpoint

    def save_then_kill():  # the server is lost right after the first checkpoint (SIGKILL)
        path = save()
        if t.step == 1:
            teacher_server.stop(port, sig=signal.SIGKILL)
        return path

    t.save_checkpoint = save_then_kill
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = cli.run(lambda _: t.train(), [], prog="train", rules=train_main.RULES)
    finally:
        t.close()
    folder = checkpointer.folder_of(cfg.run_dir, cfg.checkpoint)
    saved = checkpointer.list_checkpoints(folder)
    logged = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").open()]
    out = {
        "code": code,
        "stderr": err.getvalue(),
        "checkpoints": [step for step, _ in saved],
        "last_verifies": checkpointer.verify_checkpoint(Path(saved[-1][1])) if saved else "none",
        "before": [r for r in logged if r["kind"] == "train"],
    }
    teacher_server.start(
        teacher_dir,
        port=port,
        k=SERVED_K,
        name=name,
        max_model_len=256,
        eager=True,
        single_process=True,
        create_venv=False,
    )
    t = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        out["resumed_at"] = t.step
        out["after"] = [t.train_step() for _ in range(STEPS - t.step)]
    finally:
        t.close()
    return out


def onpolicy_cross(shards: str, teachers: list[dict], run_dir: Path) -> list[dict]:
    """The on-policy run of a tiny student with Gemma's tokenizer (`shards` aligned for it and
    the teachers'), so each rollout is re-tokenized and aligned for the teachers on the fly."""
    from tests.dist.test_trainer_cases import TINY

    student = {"path": str(paths.teacher_dir()), "init": "random", "seed": 1, "overrides": TINY}
    teachers = [
        {**{k: v for k, v in t.items() if k != "projection"}, "loss": "alm"}
        for t in teachers[: len(CROSS_MODES)]
    ]
    return onpolicy_run(
        lambda **top: make_cfg(shards, run_dir, teachers=teachers, model=student, **top),
        modes=CROSS_MODES,
    )


def main(shards, teacher_dir, projection, url, model, port, out, cross_shards) -> None:
    tmp = Path(out).parent / "runs"
    torch.set_num_threads(1)
    live = [{"path": teacher_dir, "name": f"t{i}", "loss": m} for i, m in enumerate(MODES)]
    live[1]["projection"] = projection  # xtoken reads the (identity) projection
    served = [
        {**t, "server": url, "served_model": model, "server_timeout_s": TIMEOUT_S} for t in live
    ]
    result: dict = {"refused": refusals(shards, served, projection)}
    result["live"] = train(make_cfg(shards, tmp / "live", teachers=live))
    result["served"] = train(make_cfg(shards, tmp / "served", teachers=served))
    result["onpolicy"] = {
        "live": onpolicy_run(lambda **top: make_cfg(shards, tmp / "op_live", teachers=live, **top)),
        "served": onpolicy_run(
            lambda **top: make_cfg(shards, tmp / "op_served", teachers=served, **top)
        ),
        "cross_live": onpolicy_cross(cross_shards, live, tmp / "x_live"),
        "cross_served": onpolicy_cross(cross_shards, served, tmp / "x_served"),
    }
    hasty = [{**t, "server_timeout_s": FAULT_TIMEOUT_S} for t in served]
    result["fault"] = fault(
        lambda **top: make_cfg(shards, tmp / "fault", teachers=hasty, **top),
        teacher_dir=teacher_dir, name=model, port=int(port),
    )  # fmt: skip
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:9])
