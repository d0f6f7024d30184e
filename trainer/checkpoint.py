"""DCP checkpoints with exact resume, and the student's export as a plain HF directory.

A checkpoint is one ``torch.distributed.checkpoint`` directory per saved step,
``<run_dir>/checkpoints/step-00000N``, holding:

- ``app.model`` / ``app.optim``: the sharded student and AdamW state (DCP reshards on load);
- ``scheduler`` and ``step``: the same on every rank;
- ``rank<r>``: what is private to a rank: its data position (shard stream) and its RNG states.
  A resumed run must use the same world size (the data layout checks it and says so).

Saving is atomic: every rank writes into ``step-N.tmp``; after DCP's own final barrier rank 0
writes ``COMPLETED`` (every file's size and xxh3_64 checksum, gathered from the ranks) and then
renames the directory to ``step-N``, so a directory without ``.tmp`` is always whole, and only
the newest ``keep`` are kept. The checksums are computed while DCP writes: its
``FileSystemWriter`` opens every file through a replaceable ``fs.create_stream``, and ours
(`_HashingFileSystem`) hands it a `tokenbridge.formats.checksums.HashingSink`, so no file is read back.

Resuming (`find_resume`, run by preflight before any model loads) verifies the checkpoint's
files against its marker. ``checkpoint.resume=auto``: the newest checkpoint that verifies; a
damaged newer one is renamed ``step-N.damaged`` (never deleted, and no longer counted) and the
run says so in one line; with ``checkpoint.strict=true`` a damaged newest one is refused
instead. A checkpoint named by path is verified and refused when damaged. A checkpoint written
before markers existed (``.metadata``, no ``COMPLETED``) is resumed from unverified (refused
in one line if DCP cannot read it).

The export (`export_student`) is the whole student gathered to rank 0 and written by
`tokenbridge.models.export_hf`: at the end of a run, and on request (``touch <run_dir>/EXPORT``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from tokenbridge import models
from tokenbridge.formats import checksums as integrity
from trainer.config.schema import CheckpointConfig, ModelConfig

STEP_PREFIX = "step-"
EXPORT_REQUEST = "EXPORT"  # touch <run_dir>/EXPORT: export the student after the next logged step
MARKER = "COMPLETED"  # the same kind of marker as a shard directory's (tokenbridge.verify reads it)
MARKER_VERSION = 1
DAMAGED = ".damaged"  # suffix of a checkpoint moved aside by a resume that found it damaged


class DamagedCheckpointError(integrity.IntegrityError):
    """The checkpoint to resume from fails its checksums (strict mode, or named by path)."""


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


def rng_state() -> bytes:
    """Every RNG a step may draw from (python, numpy, torch CPU and CUDA), as one blob."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return pickle.dumps(state)


def set_rng_state(blob: bytes) -> None:
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """Published checkpoints under `folder` (``step-N``: not ``.tmp``, not moved aside), oldest
    first: those with DCP's ``.metadata`` or our marker. One with a marker and no ``.metadata``
    is damaged, and listed so that resuming says so (`find_resume`) instead of skipping it."""
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            digits = p.name[len(STEP_PREFIX) :]
            whole = (p / ".metadata").is_file() or (p / MARKER).is_file()
            if p.name.startswith(STEP_PREFIX) and digits.isdigit() and whole:
                out.append((int(digits), p))
    return sorted(out)


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file it writes on its way to disk."""

    def __init__(self):
        super().__init__()
        self.entries: dict[str, dict] = {}  # file name -> marker entry
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        sink = integrity.HashingSink(path)
        try:
            yield sink
        except BaseException:
            sink.file.close()
            raise
        sink.close()
        with self._lock:
            self.entries[Path(path).name] = sink.entry()

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            if (e := self.entries.pop(Path(path).name, None)) is not None:
                self.entries[Path(new_path).name] = e


def verify_checkpoint(path: Path) -> str | None:
    """None when every file of checkpoint `path` matches its marker (or it has no marker: written
    before them), else the first damage found, one line naming the file."""
    if not (path / MARKER).is_file():
        return None
    try:
        sums = integrity.read_marker(path, MARKER)["checksums"]
        for name in sorted(sums):
            integrity.verify_file(path / name, sums[name])
    except (integrity.IntegrityError, OSError, KeyError, TypeError) as e:
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


def find_resume(folder: Path, cfg: CheckpointConfig, *, rank: int) -> Resume:
    """The checkpoint to resume from per ``cfg.resume`` and ``cfg.strict``, verified.

    Every rank calls it (preflight, before any process group) and reaches the same answer:
    damage is a property of the bytes. Rank 0 alone moves damaged checkpoints aside; another
    rank that finds one moved while it reads it sees a missing file, which is damage too.
    """
    if cfg.resume == "none":
        return Resume(None)
    if cfg.resume != "auto":
        path = Path(cfg.resume)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"checkpoint.resume={path}: not a whole DCP checkpoint (no .metadata)"
            )
        if (err := verify_checkpoint(path)) is not None:
            raise DamagedCheckpointError(f"checkpoint.resume={path}: {err}")
        return Resume(path, _unverified(path))
    notes: list[str] = []
    for _, path in reversed(list_checkpoints(folder)):
        err = verify_checkpoint(path)
        if err is None:
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


def _unverified(path: Path) -> list[str]:
    if (path / MARKER).is_file():
        return []
    return [f"checkpoint {path.name} has no {MARKER} (written before checksums): not verified"]


class Checkpointer:
    """Save DCP checkpoints of one run, with their marker; load one (`cfg` = the checkpoint
    section; which one to resume from is `find_resume`'s, in preflight)."""

    def __init__(self, folder: str | Path, cfg: CheckpointConfig, *, rank: int):
        self.folder = Path(folder)
        self.cfg = cfg
        self.rank = rank

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (collective: every rank calls it) and return the final directory."""
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        writer = dcp.FileSystemWriter(str(tmp))
        writer.fs = fs = _HashingFileSystem()
        dcp.save(state, storage_writer=writer)
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, fs.entries)  # each rank hashed the files it wrote
        if self.rank == 0:
            sums = {name: e for entries in gathered for name, e in entries.items()}
            marker = {
                "kind": "checkpoint",
                "version": MARKER_VERSION,
                "step": step,
                "world_size": dist.get_world_size(),
                "hash": integrity.HASH,
                "checksums": dict(sorted(sums.items())),
            }
            integrity.write_json_atomic(tmp / MARKER, marker)  # last, before the publish
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            _fsync_dir(self.folder)
            for _, old in list_checkpoints(self.folder)[: -self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill `state` (same structure as saved; Stateful values are loaded in place). A
        checkpoint without a marker (not verified) that DCP cannot read is refused in one line
        (`DamagedCheckpointError`) instead of torch's traceback from inside its reader."""
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # the latter is a BaseException
            if (Path(path) / MARKER).is_file():
                raise  # verified bytes: a real mismatch (another model), not damage
            # DCP's CheckpointException carries each rank's traceback: its last line says why
            cause = (str(e).strip().splitlines() or [type(e).__name__])[-1].strip()
            raise DamagedCheckpointError(
                f"checkpoint {path}: has no {MARKER} (written before checksums, so not "
                f"verified) and cannot be read ({cause}); resume from "
                "another one (checkpoint.resume=<dir>) or start fresh (checkpoint.resume=none)"
            ) from e


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
