"""Kill an on-policy teacher worker while it scores (a script run by test_onpolicy_run.py, in its
own process: the Trainer joins a process group, which must not leak into the test process).

``python tests/e2e/onpolicy_kill.py SHARDS RUN_DIR`` builds the onpolicy_debug Trainer (teacher
workers), submits a step's rollouts, SIGKILLs the first teacher's worker and times how long the
step's receive takes to fail; prints one JSON line: the error's type, message and seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch.distributed as dist

from trainer.loop import Trainer
from trainer.main import load_config
from trainer.preflight import preflight


def main(shards: str, run_dir: str) -> dict:
    cfg = load_config(["conf=onpolicy_debug", f"data.shards={shards}", f"run_dir={run_dir}",
                       "device=cpu", "logging.progress=false", "logging.report=false",
                       "parallel.teacher_timeout_s=60"])  # fmt: skip
    trainer = Trainer(cfg, preflight(cfg, world_size=1))
    try:
        op = trainer.onpolicy
        batches = op.batches(op.generate())
        op.submit(batches)
        os.kill(op.channels[0].worker_pid, signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            op.receive(len(batches))
        except Exception as e:  # the error under test
            return {"error": type(e).__name__, "message": str(e),
                    "seconds": time.perf_counter() - t0}  # fmt: skip
        return {"error": None, "message": "", "seconds": time.perf_counter() - t0}
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
