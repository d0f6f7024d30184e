"""Entry point: ``torchrun --nproc_per_node=N trainer/main.py conf=<experiment> [overrides]``.

Also ``python trainer/main.py conf=debug`` (one process: world size 1 of the same code path).
Thin, as in torchtitan: compose and validate the config, run the checks that need no model
(`trainer.config.preflight`), build the `Trainer`, ``try: train() finally: close()``, destroy the
process group. ``conf=<name>`` selects ``conf/experiment/<name>.yaml`` (``experiment=<name>``
works too); every other argument is a Hydra override (``optim.lr=1e-4``,
``teachers.0.weight=0.5``, ``loss.options.k=16``...). Every key must exist in `trainer.config.schema`:
``+``/``++`` add no keys (they are accepted and checked the same), except under the open
``loss.options`` and ``model.overrides`` (``+loss.options.beta=0.3``).

A failure ends with one line on stderr and an exit code (`tokenbridge.cli`, rules in
`trainer.errors`): 2 invalid config or inputs (a config key, a missing or damaged file, shards
made with other tokenizers), 1 the run failed (a teacher worker died, a non-finite loss), 130
interrupted; ``TOKENBRIDGE_DEBUG=1`` adds the traceback. Under torchrun an error every rank
meets alike is reported by rank 0, any other by the rank it happened on; ``python -m
trainer.launch`` (torchrun's arguments) also replaces torchrun's own failure report.
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

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

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
    # computed from all-reduced numbers: every rank stops at the same step
    cli.Rule(("trainer.run_log.NonFiniteError",), everywhere=True),
    # a damaged file or out-of-range value met during the run (docs/integrity.md): the data's
    # fault, named in one line; nothing was trained on it
    cli.Rule(("tokenbridge.formats.checksums.IntegrityError",), cli.EXIT_USAGE),
    cli.Rule(
        ("torch.OutOfMemoryError",),
        hint="lower data.micro_batch_size (raise data.grad_accum to keep the batch)",
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


def check_override_keys(overrides: list[str]) -> None:
    """ConfigError for an override whose key is not in the schema, before Hydra composes: for
    ``optim.lrr=1`` Hydra's own message suggests ``+optim.lrr=1``, which would run and ignore
    it. Config-group choices (``loss=xtoken``, ``experiment=demo``) are Hydra's to check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.config.schema import check_key

    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        if (CONF_DIR / key).is_dir() or key.split(".")[0] == "hydra":
            continue
        check_key(key)


def hydra_message(e: Exception) -> str:
    """Hydra's multi-line error as one line: its lines up to the config search path, a heading's
    items after it ("Available options in 'experiment': debug, demo"), and the cause it wraps
    ("Error merging override optim.lr=abc (Value 'abc' could not be converted to Float)")."""
    text = str(e).split("Config search path:")[0]
    parts: list[str] = []
    for raw in text.splitlines():
        part = raw.strip()
        if not part:
            continue
        if parts and parts[-1].endswith(":"):  # a heading, then its first item
            parts[-1] += " " + part
        elif parts and raw[:1].isspace():  # the next (indented) item of that list
            parts[-1] += ", " + part
        else:
            parts.append(part)
    out = "; ".join(parts)
    cause = e.__cause__ and str(e.__cause__).strip().splitlines()
    return f"{out} ({cause[0].strip()})" if cause and cause[0].strip() not in out else out


def load_config(argv: list[str]):
    """Compose conf/train.yaml with the overrides into a validated `TrainConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from trainer.config.schema import ConfigError, from_dictconfig, register_schema

    register_schema()
    overrides = hydra_overrides(argv)
    try:
        check_override_keys(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose(config_name="train", overrides=overrides)
    except HydraException as e:
        raise ConfigError(f"config: {hydra_message(e)}") from e
    OmegaConf.resolve(composed)
    return from_dictconfig(composed)


def run(argv: list[str]) -> int:
    """Check, build, train, close (the body of `main`; failures are `main`'s to report)."""
    try:
        cfg = load_config(argv)
        from trainer.config.preflight import preflight

        prepared = preflight(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except Exception as e:
        # nothing is loaded yet, and every rank reads the same config and files
        raise cli.same_on_every_rank(e) from None

    import torch.distributed as dist

    from trainer.loop import Trainer

    # A damaged shard or an out-of-range value met during the run (tokenbridge.formats.checksums's
    # errors, ValueErrors) ends it like any input error: one line naming the file, exit 2
    # (`tokenbridge.cli`), by the rank that read it; nothing was trained on that row.
    trainer = None
    try:
        trainer = Trainer(cfg, prepared)
        trainer.train()
    finally:
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
