"""Hydra's composition of ``conf/`` into a validated `TrainConfig`, with Hydra's errors as
ConfigErrors of one line.

Every override's key is looked up in the schema before Hydra composes (`check_override_keys`:
Hydra's own message for ``optim.lrr=1`` suggests ``+optim.lrr=1``, which would run and ignore
it). Hydra is imported on first use: the entry point imports this module before it knows
whether a config is needed at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainer.config.checks import ConfigError

if TYPE_CHECKING:
    from trainer.config.schema import TrainConfig

CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"


def check_override_keys(overrides: list[str]) -> None:
    """ConfigError for an override whose key is not in the schema, before Hydra composes.
    Config-group choices (``loss=xtoken``, ``experiment=demo``) are Hydra's to check."""
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


def compose_config(overrides: list[str]) -> TrainConfig:
    """Compose conf/train.yaml with Hydra `overrides` into a validated `TrainConfig`."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from trainer.config.schema import from_dictconfig, register_schema

    register_schema()
    try:
        check_override_keys(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            composed = compose(config_name="train", overrides=overrides)
    except HydraException as e:
        raise ConfigError(f"config: {hydra_message(e)}") from e
    OmegaConf.resolve(composed)
    return from_dictconfig(composed)
