"""Entry point: ``torchrun --nproc_per_node=N trainer/main.py conf=<experiment> [overrides]``.

Also ``python trainer/main.py conf=debug`` (one process: world size 1 of the same code path).
Thin, as in torchtitan: compose and validate the config, run the checks that need no model
(`trainer.preflight`), build the `Trainer`, ``try: train() finally: close()``, destroy the
process group. ``conf=<name>`` selects ``conf/experiment/<name>.yaml`` (``experiment=<name>``
works too); every other argument is a Hydra override (``optim.lr=1e-4``,
``teachers.0.weight=0.5``, ``loss.options.k=16``...). Every key must exist in `trainer.config`:
``+``/``++`` add no keys (they are accepted and checked the same), except under the open
``loss.options`` and ``model.overrides`` (``+loss.options.beta=0.3``).

Exit codes: 0 done, 2 invalid config or inputs (nothing was loaded), 1 any other failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # run as a script: import the repo's packages, not the sibling modules of this folder
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def hydra_overrides(argv: list[str]) -> list[str]:
    """``conf=<name>`` -> ``experiment=<name>``; the rest are Hydra overrides as given."""
    out = []
    for a in argv:
        if a.startswith("conf="):
            a = "experiment=" + a[len("conf=") :]
        elif a.startswith("-"):
            raise SystemExit(
                f"unknown option {a!r}: arguments are conf=<name> and key=value overrides"
            )
        out.append(a)
    return out


def check_override_keys(overrides: list[str]) -> None:
    """ConfigError for an override whose key is not in the schema, before Hydra composes: for
    ``optim.lrr=1`` Hydra's own message suggests ``+optim.lrr=1``, which would run and ignore
    it. Config-group choices (``loss=xtoken``, ``experiment=demo``) are Hydra's to check."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from trainer.config import check_key

    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.key_or_group
        if (CONF_DIR / key).is_dir() or key.split(".")[0] == "hydra":
            continue
        check_key(key)


def load_config(argv: list[str]):
    """Compose conf/train.yaml with the overrides into a validated `TrainConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from trainer.config import ConfigError, from_dictconfig, register_schema

    register_schema()
    overrides = hydra_overrides(argv)
    try:
        check_override_keys(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose(config_name="train", overrides=overrides)
    except HydraException as e:
        raise ConfigError(f"config: {e}") from None
    OmegaConf.resolve(composed)
    return from_dictconfig(composed)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from trainer.config import ConfigError

    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = load_config(argv)
        from trainer.preflight import preflight

        prepared = preflight(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        # everything a user can fix without code changes; nothing has been loaded yet
        print(f"[rank {rank}] tokenbridge: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2

    import torch.distributed as dist

    from pipelines.integrity import IntegrityError
    from trainer.train import Trainer

    trainer = None
    try:
        trainer = Trainer(cfg, prepared)
        trainer.train()
    except IntegrityError as e:
        # a damaged file or out-of-range value met during the run (docs/integrity.md): the
        # data's fault, named in one line; nothing was trained on it
        print(f"[rank {rank}] tokenbridge: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
