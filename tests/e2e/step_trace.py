"""One conf=debug training step traced call by call, run by tests/e2e/test_debug_run.py in ONE
process (a script, not a test module): ``python -m tests.e2e.step_trace SHARDS PROJECTION
RUN_DIR OUT [overrides]`` (issue 39: "a reader following one debug step enters each trainer/
file once").

The `Trainer` is built as ``trainer/main.py`` builds it (world size 1, the teacher in its
worker process); then, during one logging step (`Trainer.train_step`), every call into a
trainer/ file looks at the trainer/ files on its call stack, outermost first, consecutive
repeats merged (frames of other packages between them do not count). The step reads as the
issue's goal says when each file is one contiguous run of that list: a file that appears again
after another file was entered from it is a room whose door leads back into a room the reader
already left (``loop.py -> step.py -> shard_source.py -> loop.py``). OUT (JSON) gets every
distinct such stack and the files the step entered.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from tokenbridge import paths

TRAINER = str(paths.REPO_ROOT / "trainer") + "/"


def _trainer_files(frame) -> list[str]:
    """The trainer/ files on the stack of `frame`, outermost first, consecutive repeats merged."""
    files: list[str] = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TRAINER):
            rel = name[len(TRAINER) :]
            if not files or files[-1] != rel:
                files.append(rel)
        frame = frame.f_back
    return files[::-1]


class StepTrace:
    """A `sys.setprofile` function: the stacks on which a trainer/ file is entered twice."""

    def __init__(self) -> None:
        self.entered: set[str] = set()
        self.broken: set[tuple[str, ...]] = set()

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(TRAINER):
            return
        files = _trainer_files(frame)
        self.entered.add(files[-1])
        if len(set(files)) != len(files):
            self.broken.add(tuple(files))


def main(shards: str, projection: str, run_dir: str, out: str, *extra: str) -> None:
    from trainer.loop import Trainer
    from trainer.main import load_config
    from trainer.preflight import preflight

    cfg = load_config(["conf=debug", f"data.shards={shards}", f"teachers.0.projection={projection}",
                       f"run_dir={run_dir}", "logging.tensorboard=false", "eval.max_texts=0",
                       *extra])  # fmt: skip
    trainer = Trainer(cfg, preflight(cfg, world_size=1))
    trace = StepTrace()
    try:
        sys.setprofile(trace)
        try:
            record = trainer.train_step(log=True)
        finally:
            sys.setprofile(None)
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    result = {
        "loss": record["loss"],
        "entered": sorted(trace.entered),
        "broken": sorted(" -> ".join(s) for s in trace.broken),
    }
    Path(out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
