"""Which keys the config schema has: every key a user writes must name a field of the
`trainer.config.schema` dataclasses, with or without Hydra's ``+`` / ``++``.

Hydra's ``+optim.lrr=1`` adds the key to the composed config, OmegaConf's merge keeps it and
``to_object`` drops it, so the run would start and silently ignore the setting. Here every key
path is looked up in the dataclasses' type hints instead, an unknown one refused with the
closest valid names. Fields typed ``dict[str, Any]`` are open on purpose (``loss.options``, the
models' ``overrides``). Pure: no Hydra, no I/O.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from collections.abc import Iterator, Mapping
from typing import Any


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's fields and their resolved types, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_open(tp: Any) -> bool:
    return typing.get_origin(tp) is dict


def _list_item(tp: Any) -> Any | None:
    """X for ``list[X]``, else None."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


def _all_paths(schema: type, prefix: str = "") -> Iterator[str]:
    """Every key path of the schema (a list of sections as ``teachers.0.x``)."""
    for name, tp in field_types(schema).items():
        path = f"{prefix}{name}"
        yield path
        item = _list_item(tp)
        if dataclasses.is_dataclass(tp):
            yield from _all_paths(tp, f"{path}.")
        elif item is not None and dataclasses.is_dataclass(item):
            yield from _all_paths(item, f"{path}.0.")


def _closest(section: str, key: str, fields: dict[str, Any], schema: type) -> list[str]:
    """Valid paths near `key`: its siblings first, else any key of the schema by its last name
    (``threads`` -> ``parallel.threads``)."""
    near = difflib.get_close_matches(key, list(fields), n=3, cutoff=0.6)
    if near:
        return [f"{section}{n}" for n in near]
    by_name: dict[str, list[str]] = {}
    for p in _all_paths(schema):
        by_name.setdefault(p.rsplit(".", 1)[-1], []).append(p)
    near = difflib.get_close_matches(key, list(by_name), n=3, cutoff=0.7)
    return [p for n in near for p in by_name[n]][:3]


def unknown_key(parts: typing.Sequence[str], schema: type) -> str | None:
    """None when `parts` (a key path, list indices as digits) exists in `schema`, else what is
    wrong with it: ``optim.lrr: no such key (closest: optim.lr)``."""
    tp: Any = schema
    for i, part in enumerate(parts):
        section = ".".join(parts[:i])
        if _is_open(tp):
            return None
        item = _list_item(tp)
        if item is not None:
            if not part.isdigit():
                return f"{'.'.join(parts[: i + 1])}: {section} is a list, expected an index"
            tp = item
            continue
        if not dataclasses.is_dataclass(tp):
            return f"{'.'.join(parts[: i + 1])}: {section} is a value, not a section"
        fields = field_types(tp)
        if part not in fields:
            near = _closest(f"{section}." if section else "", part, fields, schema)
            where = section or "the top level"
            hint = f"closest: {', '.join(near)}" if near else f"{where} has {', '.join(fields)}"
            return f"{'.'.join(parts[: i + 1])}: no such key ({hint})"
        tp = fields[part]
    return None


def key_paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a nested container of mappings and lists (depth first)."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            path = (*prefix, str(k))
            yield path
            yield from key_paths(v, path)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            if isinstance(v, (Mapping, list, tuple)):
                yield from key_paths(v, (*prefix, str(i)))


def unknown_keys(node: Any, schema: type) -> list[str]:
    """What `unknown_key` says about each key of `node` that is not in `schema` (the first
    unknown key of a branch only: its children are not looked up)."""
    out: list[str] = []
    bad: list[tuple[str, ...]] = []
    for path in key_paths(node):
        if any(path[: len(b)] == b for b in bad):
            continue
        msg = unknown_key(path, schema)
        if msg is not None:
            out.append(msg)
            bad.append(path)
    return out
