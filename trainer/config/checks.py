"""The one error of the trainer's configuration and the small checks every config module shares.

Every refusal of a config value says where (the field, as the user writes it in YAML or on the
command line) and what was expected: ``config loss.mode: expected one of [...], got 'kl'``. The
config sections (`trainer.config.sections`, `trainer.config.loss_sections`), the cross-field
rules (`trainer.config.rules`), the composition (`trainer.config.compose`) and the preflight
(`trainer.preflight`) all raise `ConfigError` through these helpers; nothing outside
`trainer/config/` raises it (tests/unit/test_config_rules.py checks that).

A rule that belongs to the library (a model source, the combination of KD and CE, a loss mode's
options) is written once there and raises a plain ValueError naming its own field; the config
calls it and adds the field's name in the config (`library_field`).

The loss-mode registry is imported on first use (`registry`), not with these modules: it brings
torch (about 2 s on these machines), and a config that Hydra already refuses (an unknown key, a
wrong type) should fail before that.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn, TypeVar


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def fail(where: str, msg: str) -> NoReturn:
    """Raise ``ConfigError("config <where>: <msg>")``."""
    raise ConfigError(f"config {where}: {msg}")


def check_choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        fail(where, f"expected one of {list(choices)}, got {value!r}")


def check_positive(where: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        fail(
            where, f"expected a {'non-negative' if allow_zero else 'positive'} number, got {value}"
        )


def check_at_least(where: str, value: int, low: int) -> None:
    if value < low:
        fail(where, f"expected >= {low}, got {value}")


T = TypeVar("T")


def library_field(
    build: Callable[[], T], *, prefix: str, rename: dict[str, str] | None = None
) -> T:
    """``build()``, with a library `OptionError` turned into a ConfigError that names the
    config's key: ``<prefix>.<field>``, the library's field name renamed by `rename` where the
    config calls it otherwise (``CombineConfig.mode`` is ``loss.combine``)."""
    from tokenbridge.losses.base import OptionError

    try:
        return build()
    except OptionError as e:
        fail(f"{prefix}.{(rename or {}).get(e.field, e.field)}", e.reason)


def registry() -> ModuleType:
    """`tokenbridge.losses.modes` (MODES, KD_MODES, OptionError), imported on first use."""
    import tokenbridge.losses.modes

    return tokenbridge.losses.modes
