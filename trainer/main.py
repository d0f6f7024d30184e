"""Entry point: ``torchrun --nproc_per_node=N trainer/main.py conf=<experiment> [overrides]``.

Also ``python trainer/main.py conf=debug`` (one process). ``conf=<name>`` selects
``conf/experiment/<name>.yaml``; every other argument is a Hydra override, whose key must exist
in the schema. Thin, as in torchtitan: compose and validate the config, run the preflight, build
the `Trainer`, train, close. A failure ends with one line and an exit code (`RULES` below;
README, "When something fails"); a peer that vanished without a word is named by the
ranks it left (`trainer.parallel.liveness`).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as a script: import the repo's packages, not the sibling modules of this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from tokenbridge import cli

# What a rank prints when its gloo / NCCL link breaks because another process died: that process
# reports the cause, this one exits 1 without a word (`tokenbridge.cli`, Rule.quiet).
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",  # NCCL
)


def _peer_lost(e: BaseException) -> bool:
    return any(m in str(e) for m in PEER_LOST)


def _worker_hint(e: BaseException) -> str:
    if "SIGKILL" in str(e):
        return (
            "nothing in tokenbridge sends SIGKILL: if no one did, the kernel's out-of-memory "
            "killer probably did (see `dmesg`)"
        )
    return ""


# Named, not imported: these modules import torch, which a config error should not wait for.
RULES = (
    cli.Rule(
        ("trainer.teacher.ring.TeacherTimeoutError",),
        hint="raise parallel.teacher_timeout_s if the teacher is only slow",
    ),
    # a worker of a teacher TP group that lost its peer: the peer's own rank reports the cause
    cli.Rule(("trainer.teacher.ring.TeacherWorkerError",), quiet=True, match=_peer_lost),
    cli.Rule(("trainer.teacher.ring.TeacherWorkerError",), hint=_worker_hint),
    cli.Rule(("trainer.teacher.ring.ChannelError",)),
    cli.Rule(
        ("tokenbridge.teacher.served.TeacherServerError",),
        hint="restart the server (make teacher-server), then resume: checkpoint.resume=auto",
    ),
    # computed from all-reduced numbers: every rank stops at the same step
    cli.Rule(("trainer.run_log.NonFiniteError",), everywhere=True),
    # a damaged file or out-of-range value met during the run (docs/integrity.md): the data's
    # fault, named in one line; nothing was trained on it
    cli.Rule(("tokenbridge.formats.checksums.IntegrityError",), cli.EXIT_USAGE),
    cli.Rule(
        ("torch.OutOfMemoryError",),
        hint="lower data.micro_batch_size (raise data.grad_accum to keep the batch)",
    ),
    # a peer killed outright or its node lost: this rank names it (trainer.parallel.liveness)
    cli.Rule(
        ("trainer.parallel.liveness.LostRankError",),
        hint="restart every node: the run resumes from its last checkpoint",
    ),
    cli.Rule((RuntimeError,), quiet=True, match=_peer_lost),
    cli.Rule(("torch.distributed.DistError",)),
)


def hydra_overrides(argv: list[str]) -> list[str]:
    """``conf=<name>`` -> ``experiment=<name>``; the rest are Hydra overrides as given."""
    out = []
    for a in argv:
        if a.startswith("conf="):
            a = "experiment=" + a[len("conf=") :]
        elif a.startswith("-"):
            raise cli.UsageError(
                f"unknown option {a!r}: arguments are conf=<name> and key=value overrides"
            )
        out.append(a)
    return out


def load_config(argv: list[str]):
    """The command line's arguments -> a validated `TrainConfig` (`trainer.config.compose`)."""
    from trainer.config.compose import compose_config

    return compose_config(hydra_overrides(argv))


def run(argv: list[str]) -> int:
    """Check, build, train, close (the body of `main`; failures are `main`'s to report)."""
    try:
        cfg = load_config(argv)
        from trainer.parallel.cpus import openmp_env

        # before torch is imported: OpenMP reads it once, when torch loads (trainer.parallel.cpus)
        os.environ.update(openmp_env())
        from trainer.preflight import preflight

        prepared = preflight(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except Exception as e:
        # nothing is loaded yet, and every rank reads the same config and files
        raise cli.same_on_every_rank(e) from None

    import torch.distributed as dist

    from trainer.loop import Trainer

    # A damaged shard or an out-of-range value met during the run (tokenbridge.formats.checksums's
    # errors, ValueErrors) ends it like any input error: one line naming the file, exit 2
    # (`tokenbridge.cli`), by the rank that read it; nothing was trained on that row.
    from trainer.parallel import liveness

    trainer = None
    try:
        trainer = Trainer(cfg, prepared)
        trainer.train()
    except Exception as e:
        # a collective that failed because a peer is gone without a word (kill -9, a node
        # lost): name it, since no one else will (`trainer.parallel.liveness`)
        lost = liveness.explain(e)
        if lost is not e:
            raise lost from e
        raise
    finally:
        liveness.end()  # first: a peer that sees this rank go must not call it lost
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    return cli.run(run, argv, prog="train", rules=RULES, rank=rank, world_size=world)


if __name__ == "__main__":
    code = main()
    # The run is over and closed. A SIGTERM from here on (torchrun stopping this rank because
    # another one failed) ends the process as is, instead of raising SystemExit (the channel's
    # handler) inside Python's exit handlers, which would print "Exception ignored in atexit".
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.exit(code)
