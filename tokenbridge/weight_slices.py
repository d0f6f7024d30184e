"""Pretrained weights read by slices: each process reads only the part of each tensor it holds.

Where ``from_pretrained`` reads a whole checkpoint into every process, `SafetensorsWeights`
reads from a HF directory's ``*.safetensors`` files only each process's box of each weight
(`ShardTarget`), into the shard itself where it can (`tokenbridge.safetensors_reads`), with the
strictness of `tokenbridge.models.load_pretrained`: the keys are checked before anything is read
(docs/parallelism.md, "Built on the meta device").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenbridge import safetensors_reads

INDEX = "model.safetensors.index.json"


class WeightKeysError(ValueError):
    """A state dict or weights file that does not match its model's keys (named in the message)."""


def key_names(keys: Iterable[str], *, most: int = 8) -> str:
    """Sorted keys for an error message, at most `most` of them."""
    keys = sorted(keys)
    more = f" (and {len(keys) - most} more)" if len(keys) > most else ""
    return f"{keys[:most]}{more}"


@dataclass
class ShardTarget:
    """What one process holds of a weight: `out`, its local tensor, is ``full[box]`` where
    `box` is one slice per dimension of the weight's `shape` (its global shape)."""

    out: torch.Tensor
    box: tuple[slice, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        want = tuple(s.stop - s.start for s in self.box)
        if want != tuple(self.out.shape) or len(self.box) != len(self.shape):
            raise ValueError(
                f"shard box {self.box} of a {self.shape} weight does not fit its local tensor "
                f"{tuple(self.out.shape)}"
            )

    def rows(self, start: int, stop: int) -> tuple[slice, slice] | None:
        """Where rows [start, stop) of the full weight go: (the rows of the block, the rows of
        `out`), or None when this process holds none of them."""
        if not self.box:
            return (slice(0, 0), slice(0, 0)) if start == 0 else None
        lo, hi = max(self.box[0].start, start), min(self.box[0].stop, stop)
        if lo >= hi:
            return None
        return slice(lo - start, hi - start), slice(lo - self.box[0].start, hi - self.box[0].start)

    @torch.no_grad()
    def take_rows(self, block: torch.Tensor, start: int) -> None:
        """Copy what this process holds of `block`, rows [start, start + len) of the full weight."""
        if not self.box:  # a 0-d weight is its one "row"
            self.out.copy_(block.reshape(()))
            return
        where = self.rows(start, start + block.shape[0])
        if where is not None:
            src, dst = where
            self.out[dst].copy_(block[(src, *self.box[1:])])


def whole(t: torch.Tensor) -> ShardTarget:
    """A target that holds all of `t` (an unsharded weight)."""
    return ShardTarget(t, tuple(slice(0, n) for n in t.shape), tuple(t.shape))


def _ignored(key: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, key) for p in patterns)


class SafetensorsWeights:
    """The weights of HF directory `path`: its ``*.safetensors`` files (one, or several named by
    ``model.safetensors.index.json``), read by slices. Tied weights (one parameter under two
    names) are read once, from whichever of their names the files hold."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._headers: dict[Path, dict[str, safetensors_reads.Entry]] = {}
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: self.path / f for k, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path}: no weights (*.safetensors)")
            self.file_of = {}
            for f in files:
                self.file_of.update(dict.fromkeys(self._header(f), f))

    def _header(self, f: Path) -> dict[str, safetensors_reads.Entry]:
        if f not in self._headers:  # parsed once per file
            self._headers[f] = safetensors_reads.read_header(f)
        return self._headers[f]

    def entry(self, key: str) -> safetensors_reads.Entry:
        """Where `key` lies in its file, and its dtype and shape (from the file's header)."""
        header = self._header(self.file_of[key])
        if key not in header:
            raise WeightKeysError(f"{self.file_of[key]}: no tensor {key} (named by {INDEX})")
        return header[key]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key's shape, from the files' headers (no tensor read)."""
        return {k: self.entry(k).shape for k in self.file_of}

    def plan(
        self,
        names: dict[str, list[str]],
        shapes: dict[str, tuple[int, ...]],
        *,
        ignore_missing: Iterable[str] = (),
        ignore_unexpected: Iterable[str] = (),
    ) -> dict[str, str]:
        """Which file key fills each weight: `names` maps a weight to every name it has (tied:
        several), `shapes` gives its global shape. Refused naming the keys, as
        `load_pretrained` does: missing, unexpected, mismatched."""
        have = self.shapes()
        source, missing, mismatched = {}, [], []
        for canon, aliases in names.items():
            given = [a for a in aliases if a in have]
            if not given:
                missing += [a for a in aliases if not _ignored(a, ignore_missing)]
                continue
            source[canon] = given[0]
            if tuple(have[given[0]]) != tuple(shapes[canon]):
                mismatched.append(
                    f"{given[0]} {list(have[given[0]])} vs {list(shapes[canon])} in the model"
                )
        known = {a for aliases in names.values() for a in aliases}
        unexpected = [k for k in have if k not in known and not _ignored(k, ignore_unexpected)]
        wrong = [f"missing keys {key_names(missing)}"] if missing else []
        wrong += [f"unexpected keys {key_names(unexpected)}"] if unexpected else []
        wrong += [f"mismatched keys {key_names(mismatched)}"] if mismatched else []
        if wrong:
            raise WeightKeysError(
                f"{self.path}: weights do not match config.json: {'; '.join(wrong)}"
            )
        return source

    def fill(self, targets: dict[str, ShardTarget], source: dict[str, str]) -> None:
        """Read each target's box of its key (`plan`'s `source`) into its local tensor,
        converted to its dtype; each file opened once, read in file order."""
        by_file: dict[Path, list[tuple[str, ShardTarget]]] = {}
        for canon, t in targets.items():
            by_file.setdefault(self.file_of[source[canon]], []).append((source[canon], t))
        for path, reads in by_file.items():
            reads.sort(key=lambda kt: self.entry(kt[0]).begin)
            # unbuffered: large reads go straight into the shard, no copy through a buffer
            with open(path, "rb", buffering=0) as f:
                for key, t in reads:
                    safetensors_reads.read_box(f, self.entry(key), t, what=f"{path}: {key}")
