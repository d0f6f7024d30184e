"""DCP checkpoints with exact resume, and the student's export as a plain HF directory.

A checkpoint holds nothing that runs code when resumed (tensors through DCP, every other value
JSON: `state_split`, `dcp_io`), is published whole or not at all (written as ``step-N.tmp``,
``COMPLETED`` with every file's checksum written last, then renamed), and is verified before a
run resumes from it (`find_resume`, in preflight: a damaged newest one is moved aside, or
refused). Layout and rules: docs/integrity.md, "Checkpoints".
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from tokenbridge import atomic, cli, models, urls
from tokenbridge.formats import checksums
from trainer.checkpoint import remote, state_split
from trainer.checkpoint.dcp_io import (
    DamagedCheckpointError,
    SafePlanner,
    SafeReader,
    UnsafeCheckpointError,
    Writer,
    read_index,
    read_json,
)
from trainer.config.schema import CheckpointConfig, ModelConfig

STEP_PREFIX = "step-"
EXPORT_REQUEST = "EXPORT"  # touch <run_dir>/EXPORT: export the student after the next logged step
MARKER = "COMPLETED"  # the same kind of marker as a shard directory's (tokenbridge.commands.verify reads it)
MARKER_VERSION = 1
DAMAGED = ".damaged"  # suffix of a checkpoint moved aside by a resume that found it damaged
STATE_FORMAT, STATE_VERSION = "tokenbridge-checkpoint-state", 1  # rank<r>.json


class ModelOptimState(Stateful):
    """Model + optimizer as one DCP `Stateful` (sharded state dicts, FQN keyed)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def rng_state() -> dict[str, Any]:
    """Every RNG a step may draw from (python, numpy, torch CPU and CUDA): JSON values (the
    first two) and byte tensors (torch's)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, key.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def folder_of(run_dir: str | Path, cfg: CheckpointConfig) -> Path | str:
    """Where a run's checkpoints go: ``checkpoint.dir`` (a local path or a URL), by default
    ``<run_dir>/checkpoints``."""
    if urls.is_url(cfg.dir):
        return cfg.dir
    return Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"


def step_dir(folder: Path | str, step: int) -> Path | str:
    if urls.is_url(folder):
        return remote.step_url(folder, step)
    return folder / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(folder: Path | str) -> list[tuple[int, Path | str]]:
    """Published checkpoints under `folder` (``step-N``: not ``.tmp``, not moved aside), oldest
    first: those with DCP's ``.metadata`` or our marker. One with a marker and no ``.metadata``
    is damaged, and listed so that resuming says so (`find_resume`) instead of skipping it.
    In an object store: those with ``COMPLETED`` (`remote.list_steps`)."""
    if urls.is_url(folder):
        return remote.list_steps(folder)
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            digits = p.name[len(STEP_PREFIX) :]
            whole = (p / ".metadata").is_file() or (p / MARKER).is_file()
            if p.name.startswith(STEP_PREFIX) and digits.isdigit() and whole:
                out.append((int(digits), p))
    return sorted(out)


def verify_checkpoint(path: Path) -> str | None:
    """None when every file of checkpoint `path` matches its marker (or it has no marker: written
    before them), else the first damage found, one line naming the file."""
    if not (path / MARKER).is_file():
        return None
    try:
        sums = checksums.read_marker(path, MARKER)["checksums"]
        for name in sorted(sums):
            checksums.verify_file(path / name, sums[name])
    except (checksums.IntegrityError, OSError, KeyError, TypeError) as e:
        return str(e)  # OSError: a file gone, e.g. moved aside by rank 0 while another read it
    return None


def _move_aside(path: Path) -> Path:
    aside, n = path.with_name(path.name + DAMAGED), 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}{DAMAGED}.{n}"), n + 1
    with contextlib.suppress(FileNotFoundError):  # another process moved it first: same verdict
        path.rename(aside)
    return aside


@dataclass
class Resume:
    """The checkpoint a run resumes from (None: start fresh) and what it says about it."""

    path: Path | None
    notes: list[str] = field(default_factory=list)  # one line each, printed by rank 0


def find_resume(
    folder: Path | str, cfg: CheckpointConfig, *, rank: int, cache=None, cache_limit: int = 0
) -> Resume:
    """The checkpoint to resume from per ``cfg.resume`` and ``cfg.strict``, verified.

    Every rank calls it (preflight, before any process group) and reaches the same answer:
    damage is a property of the bytes. Rank 0 alone moves damaged checkpoints aside; another
    rank that finds one moved while it reads it sees a missing file, which is damage too.
    In an object store (`folder` or ``cfg.resume`` a URL): its verified copy in the node's
    input cache `cache` (a directory, at most `cache_limit` bytes; `remote.find_resume`).
    """
    if cfg.resume == "none":
        return Resume(None)
    if urls.is_url(folder) or urls.is_url(cfg.resume):
        path, notes = remote.find_resume(str(folder), cfg, cache_dir=cache, limit_bytes=cache_limit)
        if path is not None:
            check_readable(path)
        return Resume(path, notes)
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"checkpoint.resume={path}: not a whole DCP checkpoint (no .metadata)"
            )
        if (err := verify_checkpoint(path)) is not None:
            raise DamagedCheckpointError(f"checkpoint.resume={path}: {err}")
        check_readable(path)
        return Resume(path, _unverified(path))
    notes: list[str] = []
    for _, path in reversed(list_checkpoints(folder)):
        err = verify_checkpoint(path)
        if err is None:
            check_readable(path)  # verified is not safe: a planted file re-hashed verifies
            if notes:
                notes[-1] += f"; resuming from {path.name}"
            return Resume(path, notes + _unverified(path))
        if cfg.strict:
            raise DamagedCheckpointError(
                f"checkpoint {path.name} is damaged ({err}); checkpoint.strict=true refuses to "
                "fall back to an older one: restore it, or run with checkpoint.strict=false"
            )
        aside = _move_aside(path) if rank == 0 else path.with_name(path.name + DAMAGED)
        notes.append(f"checkpoint {path.name} is damaged ({err}); moved aside to {aside.name}")
    if notes:
        raise DamagedCheckpointError(
            "; ".join(notes) + f"; no checkpoint in {folder} verifies: restore one, or run again "
            "to start from step 0"
        )
    return Resume(None)


def check_readable(path: Path) -> None:
    """Refuse checkpoint `path` unless its index and every state file are ours: JSON (a pickle
    is `UnsafeCheckpointError`, anything else `DamagedCheckpointError`; neither is unpickled).
    Preflight calls it on every rank before any model loads; the tensor records are checked by
    the weights-only reader as `Checkpointer.load` reads them."""
    read_index(path)
    for f in sorted(path.glob("rank*.json")):
        _state_doc(f)


def _state_doc(path: Path) -> dict[str, Any]:
    """The state document of a ``rank<r>.json`` (`Checkpointer.save`)."""
    doc = read_json(path)
    ours = isinstance(doc, dict) and (doc.get("format"), doc.get("version")) == (
        STATE_FORMAT,
        STATE_VERSION,
    )
    if not ours or not isinstance(doc.get("state"), dict):
        raise DamagedCheckpointError(f"{path}: not a tokenbridge checkpoint state file")
    return doc["state"]


def saved_world(path: Path) -> int:
    """How many processes wrote checkpoint `path` (its marker's ``world_size``, or its
    ``rank<r>.json`` files for one written before markers)."""
    path = Path(path)
    if (path / MARKER).is_file():
        world = checksums.read_marker(path, MARKER).get("world_size")
        if isinstance(world, int) and world >= 1:
            return world
    return len(list(path.glob("rank*.json")))


def saved_positions(path: Path) -> list[dict[str, Any]]:
    """Every saved rank's data position (plain values, no tensor), rank by rank."""
    path = Path(path)
    out = []
    for r in range(saved_world(path)):
        mine = _state_doc(path / f"rank{r}.json").get(f"rank{r}", {})
        out.append(state_split.join(mine.get("data"), {}))
    return out


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with each DCP `Stateful` (the student and optimizer) replaced by its state dict."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def _unverified(path: Path) -> list[str]:
    if (path / MARKER).is_file():
        return []
    return [f"checkpoint {path.name} has no {MARKER} (written before checksums): not verified"]


class Checkpointer:
    """Save DCP checkpoints of one run, with their marker; load one (`cfg` = the checkpoint
    section; which one to resume from is `find_resume`'s, in preflight)."""

    def __init__(self, folder: str | Path, cfg: CheckpointConfig, *, rank: int):
        self.folder = folder if urls.is_url(folder) else Path(folder)
        self.cfg = cfg
        self.rank = rank

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (collective: every rank calls it) and return the final directory:
        its tensors through DCP, the rest as ``rank<r>.json`` (`trainer.checkpoint.state_split`)."""
        final = step_dir(self.folder, step)
        in_store = urls.is_url(final)  # written in place: COMPLETED is the commit, no rename
        tmp = final if in_store else final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if in_store:
                remote.clear(final)  # an unfinished save of this step
            elif tmp.exists():
                shutil.rmtree(tmp)
            if not in_store:
                tmp.mkdir(parents=True)
        dist.barrier()
        doc, tensors = state_split.split(_plain(state))
        writer = remote.Writer(final) if in_store else Writer(tmp)
        state_file = {"format": STATE_FORMAT, "version": STATE_VERSION, "rank": self.rank}
        rank_file = writer.fs.concat_path(tmp, f"rank{self.rank}.json")
        writer.fs.write_json(rank_file, {**state_file, "state": doc})
        dcp.save(tensors, storage_writer=writer)
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, writer.fs.entries)  # each rank hashed what it wrote
        if self.rank == 0:
            sums = {name: e for entries in gathered for name, e in entries.items()}
            marker = {
                "kind": "checkpoint",
                "version": MARKER_VERSION,
                "step": step,
                "world_size": dist.get_world_size(),
                "hash": checksums.HASH,
                "checksums": dict(sorted(sums.items())),
            }
            if in_store:
                remote.publish(self.folder, final, marker, keep=self.cfg.keep)
        if self.rank == 0 and not in_store:
            checksums.write_json_atomic(tmp / MARKER, marker)  # last, before the publish
            atomic.replace(tmp, final)
            _fsync_dir(self.folder)
            for _, old in list_checkpoints(self.folder)[: -self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: Path, state: dict[str, Any], *, from_rank: int | None = None) -> None:
        """Fill `state` (same structure as saved; Stateful values are loaded in place), every
        rank alike (collective). Refused in one line, on every rank: a file that is a pickle or
        a tensor record that names code (`UnsafeCheckpointError`), and a checkpoint without a
        marker (not verified) that cannot be read (`DamagedCheckpointError`), instead of
        torch's traceback from inside its reader. `from_rank`: read the plain values from that
        rank's file instead of this rank's (a resume on another world size: `state` then holds
        no rank's private values)."""
        path = Path(path)
        live = _plain(state)
        rank = self.rank if from_rank is None else from_rank
        index, saved, tensors = _on_every_rank(lambda: self._read(path, live, rank))
        try:
            dcp.load(tensors, storage_reader=SafeReader(path, index), planner=SafePlanner())
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            raise self._unreadable(path, e) from e
        loaded = state_split.join(saved, tensors)
        for k, v in state.items():
            if isinstance(v, Stateful):
                v.load_state_dict(loaded[k])
            else:
                state[k] = loaded[k]

    def _read(self, path: Path, live: dict[str, Any], rank: int) -> tuple:
        """DCP's index, rank `rank`'s state document and the tensors DCP is to fill, checked
        before anything is loaded (`_on_every_rank`: a failure stops every rank alike)."""
        index = read_index(path)
        f = path / f"rank{rank}.json"
        if not f.is_file():
            n = len(list(path.glob("rank*.json")))
            raise ValueError(
                f"checkpoint {path}: no {f.name}: it was saved by {n} processes and this run "
                f"has {dist.get_world_size()}; resume it with {n}"
            )
        saved = _state_doc(f)
        if missing := sorted(set(live) - set(saved)):
            raise ValueError(f"{f}: holds no {missing} (saved by another setup)")
        try:
            tensors = state_split.destinations(saved, state_split.split(live)[1])
            state_split.join(saved, tensors)  # every reference and tag is whole
        except (KeyError, TypeError, ValueError) as e:
            raise DamagedCheckpointError(f"{f}: not a tokenbridge checkpoint state ({e!r})") from e
        return index, saved, tensors

    def _unreadable(self, path: Path, e: BaseException) -> BaseException:
        """What to raise for DCP's failure `e` to read checkpoint `path`."""
        failures = e.failures.values() if isinstance(e, CheckpointException) else [(e, None)]
        for err, _ in failures:  # every rank holds every rank's failure: they raise alike
            if isinstance(err, (UnsafeCheckpointError, DamagedCheckpointError)):
                return cli.same_on_every_rank(err)
        if (path / MARKER).is_file():
            return e  # verified bytes: a real mismatch (another model), not damage
        # DCP's CheckpointException carries each rank's traceback: its last line says why
        cause = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
        return DamagedCheckpointError(
            f"checkpoint {path}: has no {MARKER} (written before checksums, so not "
            f"verified) and cannot be read ({cause}); resume from "
            "another one (checkpoint.resume=<dir>) or start fresh (checkpoint.resume=none)"
        )


def _on_every_rank(read):
    """``read()`` on every rank; if it fails on any, every rank raises the first failure (a
    rank alone would leave the others waiting in DCP's collectives)."""
    try:
        out, err = read(), None
    except (checksums.IntegrityError, ValueError, OSError) as e:
        out, err = None, e
    errors: list[BaseException | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    first = next((x for x in errors if x is not None), None)
    if first is not None:
        raise cli.same_on_every_rank(first)
    return out


def _fsync_dir(path: Path) -> None:
    """Make the rename durable (best effort: not every file system opens directories)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole unsharded student on rank 0's CPU (empty elsewhere); collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def export_requested(run_dir: Path, *, device: torch.device, is_main: bool) -> bool:
    """True on every rank when rank 0 sees ``<run_dir>/EXPORT`` (the file is then removed).
    Collective, and a host sync: the loop asks on logging steps only."""
    flag = torch.zeros(1, device=device)
    request = run_dir / EXPORT_REQUEST
    if is_main and request.exists():
        request.unlink()
        flag += 1
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def export_student(
    model: nn.Module, cfg: ModelConfig, out: Path, *, extra: dict, is_main: bool
) -> Path:
    """The student as a plain HF directory `out`, written by rank 0 (collective)."""
    sd = full_model_state_dict(model)
    if is_main:
        models.export_hf(sd, cfg=cfg, out_dir=out, extra=extra)
    dist.barrier()
    return out
