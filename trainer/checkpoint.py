"""DCP checkpoints with exact resume, and the student's export as a plain HF directory.

A checkpoint is one ``torch.distributed.checkpoint`` directory per saved step,
``<run_dir>/checkpoints/step-00000N``, holding:

- ``app.model`` / ``app.optim``: the sharded student and AdamW state (DCP reshards on load);
- ``scheduler`` and ``step``: the same on every rank;
- ``rank<r>``: what is private to a rank: its data position (shard stream) and its RNG states.
  A resumed run must use the same world size (the data layout checks it and says so).

Saving is atomic: every rank writes into ``step-N.tmp``; after DCP's own final barrier rank 0
renames it to ``step-N``, so a directory without ``.tmp`` is always whole, and only the newest
``keep`` are kept. ``checkpoint.resume=auto`` picks the newest whole one.

The export (`export_student`) is the whole student gathered to rank 0 and written by
`trainer.models.export_hf`: at the end of a run, and on request (``touch <run_dir>/EXPORT``).
"""

from __future__ import annotations

import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer import models
from trainer.config import CheckpointConfig, ModelConfig

STEP_PREFIX = "step-"
EXPORT_REQUEST = "EXPORT"  # touch <run_dir>/EXPORT: export the student after the next logged step


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
    """Whole checkpoints (no ``.tmp``, DCP metadata present) under `folder`, oldest first."""
    out = []
    if folder.is_dir():
        for p in folder.iterdir():
            digits = p.name[len(STEP_PREFIX) :]
            if p.name.startswith(STEP_PREFIX) and digits.isdigit() and (p / ".metadata").is_file():
                out.append((int(digits), p))
    return sorted(out)


class Checkpointer:
    """Save / find / load DCP checkpoints of one run (`cfg` = the checkpoint section)."""

    def __init__(self, folder: str | Path, cfg: CheckpointConfig, *, rank: int):
        self.folder = Path(folder)
        self.cfg = cfg
        self.rank = rank

    def resume_path(self) -> Path | None:
        """The checkpoint to resume from per ``cfg.resume``, or None to start fresh."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            found = list_checkpoints(self.folder)
            return found[-1][1] if found else None
        path = Path(self.cfg.resume)
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"checkpoint.resume={path}: not a whole DCP checkpoint (no .metadata)"
            )
        return path

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (collective: every rank calls it) and return the final directory."""
        final = step_dir(self.folder, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(state, checkpoint_id=str(tmp))
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for _, old in list_checkpoints(self.folder)[: -self.cfg.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: Path, state: dict[str, Any]) -> None:
        """Fill `state` (same structure as saved; Stateful values are loaded in place)."""
        dcp.load(state, checkpoint_id=str(path))


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
