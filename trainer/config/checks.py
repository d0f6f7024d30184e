"""The one error of the trainer's configuration and the small checks every config module shares.

Every refusal of a config value says where (the field, as the user writes it) and what was
expected: ``config loss.mode: expected one of [...], got 'kl'``. Only the config package and
the preflight raise `ConfigError` (tests/unit/test_config_rules.py checks that); a rule that
belongs to the library raises its own error, and `library_field` adds the config's field name.
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
    """`tokenbridge.losses.modes` (MODES, KD_MODES, OptionError), imported on first use: it
    brings torch (about 2 s on these machines), and a config that Hydra already refuses (an
    unknown key, a wrong type) should fail before that."""
    import tokenbridge.losses.modes

    return tokenbridge.losses.modes
