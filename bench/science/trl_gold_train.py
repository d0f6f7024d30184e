"""``python -m bench.science.trl_gold_train <trainer/main.py arguments>``: the trainer with the
bench-only ``trl_gold`` loss mode registered (the science table's TRL GOLD row, issue 16).

    python -m bench.science.trl_gold_train conf=demo loss=ce loss.mode=trl_gold loss.kd_weight=1.0

``loss=ce`` picks a loss group without options (the demo's xtoken ``k`` would be refused);
``loss.kd_weight=1.0`` restores the weight every KD group sets.
"""

from __future__ import annotations

import os
import signal
import sys

from tokenbridge import cli
from trainer import main as trainer_main

TOKENIZER_OPTIONS = (("teacher_tokenizer", "teacher"), ("student_tokenizer", "student"))


def trl_argv(argv: list[str]) -> list[str]:
    """``argv`` plus what ``trl_gold`` needs and ``argv`` leaves unset: the tokenizer options,
    and whole logits (``parallel.logits_chunk=0``: TRL's loss indexes a logits tensor, not our
    `HeadLogits`; refused when ``argv`` names another chunk)."""
    cfg = trainer_main.load_config(argv)
    modes = cfg.teacher_modes() if cfg.kd_enabled else []
    if "trl_gold" not in modes:
        return list(argv)
    if len(cfg.teachers) != 1:
        raise cli.UsageError(f"trl_gold takes one teacher, the config has {len(cfg.teachers)}")
    paths = {"teacher": cfg.teachers[0].path, "student": cfg.model.path}
    extra = [
        f"+loss.options.{key}={paths[side]}"
        for key, side in TOKENIZER_OPTIONS
        if cfg.loss.options.get(key) is None
    ]
    named = [a for a in argv if a.lstrip("+").startswith("parallel.logits_chunk=")]
    if named and cfg.parallel.logits_chunk != 0:
        raise cli.UsageError(
            f"trl_gold reads whole logits (TRL's own code): {named[-1]} must be 0 or left out"
        )
    if not named:
        extra.append("parallel.logits_chunk=0")
    return [*argv, *extra]


def run(argv: list[str]) -> int:
    # here, not at the top: a spawned teacher worker that re-imports this module as its main
    # needs none of it (it computes the outputs of the spec it is handed) and imports no trl
    import bench.science.trl_gold  # noqa: F401  (registers loss.mode=trl_gold)

    return trainer_main.run(trl_argv(argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return cli.run(run, argv, prog="trl_gold_train", rules=trainer_main.RULES, rank=rank,
                   world_size=world)  # fmt: skip


if __name__ == "__main__":
    code = main()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as trainer/main.py: a late SIGTERM ends it
    sys.exit(code)
