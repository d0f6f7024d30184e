"""Checks that run before any model loads: files, tokenizers, fingerprints, layouts.

A run that would fail at step 0 or later (a missing shard marker, shards or a projection made
with another tokenizer, a TP size that does not split the heads, a damaged shard or checkpoint)
fails here, in seconds, naming the file and the field. Only tokenizers, shard metadata,
projection tables and config.json files are read, plus the files ``data.verify`` hashes and the
checkpoint to resume from. The config's rules are called, never restated (`trainer.config.rules`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from tokenbridge import models
from tokenbridge.formats.shards import ShardSet, open_shards
from tokenbridge.formats.teacher_cache_reader import CacheSet
from tokenbridge.losses.modes import MODES
from tokenbridge.projection import Projection, load_projection
from tokenbridge.tokenizers import Tokenizer, load_tokenizer
from trainer.checkpoint.checkpointer import find_resume, folder_of, list_checkpoints
from trainer.config import rules
from trainer.config.precision import Precision, resolve_precision
from trainer.config.schema import ConfigError, ModelConfig, TrainConfig
from trainer.data.remote_inputs import DEFAULT_DIR, localize
from trainer.data.shard_reader import ShardReader
from trainer.parallel import parallelize
from trainer.teacher.cached_teacher import open_teacher_cache
from trainer.teacher.served_teacher import open_served


@dataclass
class Prepared:
    """What the checks loaded, handed to the trainer so nothing is read twice."""

    student_tok: Tokenizer
    teacher_toks: list[Tokenizer]
    shards: ShardSet
    projections: list[Projection | None]  # per teacher; None where the loss needs none
    student_rows: int  # lm_head width from config.json (the tokenizer may be smaller)
    teacher_rows: list[int]
    teacher_max_len: list[int]  # longest teacher row per teacher (sizes the channel slots)
    precision: Precision  # the dtypes and optimizer kernel on this run's device
    resume: Path | None = None  # the verified checkpoint to resume from (None: start fresh)
    caches: list[CacheSet | None] = field(default_factory=list)  # per teacher (teachers[i].cache)
    served: list[dict | None] = field(default_factory=list)  # per teacher: its server's report


def _model_dir(cfg: ModelConfig, where: str) -> Path:
    path = Path(cfg.path)
    if not path.is_dir():
        raise FileNotFoundError(f"{where}.path={path}: no such model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{where}.path={path}: no config.json (expected a HF model dir)")
    if cfg.init == "pretrained" and not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"{where}.path={path}: no *.safetensors weights for init=pretrained"
        )
    return path


def _tokenizer(cfg: ModelConfig, where: str) -> Tokenizer:
    try:
        if getattr(cfg, "server", None):  # a served teacher: a tokenizer dir is enough here
            return load_tokenizer(cfg.path)
        return load_tokenizer(_model_dir(cfg, where))
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"{where}: cannot load the tokenizer of {cfg.path}: {e}") from e


def preflight(cfg: TrainConfig, *, world_size: int) -> Prepared:
    """Every check that needs no model weights. Raises ConfigError / FileNotFoundError /
    pipelines' FingerprintMismatchError, ProjectionMismatchError, ... with a clear message."""
    rules.check_world(cfg, world_size=world_size)
    for where, (url, local) in localize(cfg).items():  # object-store inputs: local copies
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"tokenbridge train: {where}={url}: reading its copy {local}", file=sys.stderr)
    folder = folder_of(cfg.run_dir, cfg.checkpoint)
    old = list_checkpoints(folder)
    if old and cfg.checkpoint.resume == "none":
        raise ConfigError(
            f"config run_dir={cfg.run_dir}: holds checkpoints of an earlier run (up to step "
            f"{old[-1][0]}) and checkpoint.resume=none; continue it with checkpoint.resume=auto, "
            "or use another run_dir (or delete this one)"
        )
    # the global rank: torchrun's env, or the group's when one exists (multi-process tests)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    resume = find_resume(
        folder,
        cfg.checkpoint,
        rank=rank,
        cache=cfg.data.cache_dir or DEFAULT_DIR,
        cache_limit=int(cfg.data.cache_limit_gb * 1e9),
    )
    for note in resume.notes if rank == 0 else []:
        print(f"tokenbridge train: {note}", file=sys.stderr, flush=True)
    student = _tokenizer(cfg.model, "model")
    teachers = [_tokenizer(t, f"teachers[{i}]") for i, t in enumerate(cfg.teachers)]
    rules.check_tokenizers(cfg, student, teachers)  # each teacher's modes against its pair
    # resolved here for the run's device: a teacher cache is checked against the dtype the
    # teacher would run in
    precision = resolve_precision(cfg, device=parallelize.pick_device(cfg.device).type)

    student_hf = models.model_config(cfg.model)
    for key, check in (("tp", parallelize.check_tp), ("cp", parallelize.check_cp)):
        try:
            check(student_hf, getattr(cfg.parallel, key), where="model")
        except ValueError as e:
            raise ConfigError(f"config parallel.{key}: {e}") from None
    student_rows = int(student_hf.vocab_size)
    if student_rows < student.vocab_size:
        raise ConfigError(
            f"model {cfg.model.path}: lm_head has {student_rows} rows but the tokenizer emits "
            f"ids up to {student.vocab_size - 1}"
        )
    teacher_rows = []
    for i, t_cfg in enumerate(cfg.teachers):
        if t_cfg.server and not (Path(t_cfg.path) / "config.json").is_file():
            teacher_rows.append(teachers[i].vocab_size)  # the server holds the model
            continue
        hf = models.model_config(t_cfg)
        try:
            parallelize.check_tp(hf, t_cfg.tp, where=f"teachers[{i}]")
        except ValueError as e:
            raise ConfigError(f"config teachers[{i}].tp: {e}") from None
        teacher_rows.append(int(hf.vocab_size))

    if not Path(cfg.data.shards).is_dir():
        raise FileNotFoundError(
            f"data.shards={cfg.data.shards}: no such shard directory; make it with "
            f"`make align DATA='<glob>' OUT={cfg.data.shards}` (conf/experiment/*.yaml say which)"
        )
    shards = (
        open_shards(
            cfg.data.shards,
            student=student.info(),
            teachers=[t.info() for t in teachers],
            # first_open and preflight both hash the files here, as the row-length scan maps
            # every file anyway
            verify=cfg.data.verify,
        )
        if teachers
        else open_shards(cfg.data.shards, student=student.info(), verify=cfg.data.verify)
    )

    # the longest rows, from the Arrow list lengths: a row over the limit fails now, not at step N
    _, teacher_max = ShardReader(
        shards, max_student_tokens=cfg.data.max_student_tokens
    ).max_lengths()

    # the projections the off-policy losses read (`rules.check_tokenizers` made sure they are
    # named); the on-policy step loads its own (`trainer.onpolicy.teachers`)
    projections: list[Projection | None] = []
    for i, (t_cfg, tok, mode) in enumerate(zip(cfg.teachers, teachers, cfg.teacher_modes())):
        if cfg.kd_enabled and MODES[mode].projection:
            p = load_projection(t_cfg.projection, teacher=tok.info(), student=student.info())
            rows_t, rows_s = int(p.meta["teacher_rows"]), int(p.meta["student_rows"])
            if rows_t < teacher_rows[i] or rows_s < student_rows:
                raise ConfigError(
                    f"{t_cfg.projection}: {rows_t} teacher / {rows_s} student rows, the models' "
                    f"lm_heads have {teacher_rows[i]} / {student_rows}; rebuild it with the "
                    "model dirs (make projection TEACHER=<dir> STUDENT=<dir>)"
                )
            projections.append(p)
        else:
            projections.append(None)
    return Prepared(
        student,
        teachers,
        shards,
        projections,
        student_rows,
        teacher_rows,
        teacher_max[: len(teachers)],
        resume=resume.path,
        caches=_caches(cfg, teachers, shards, precision=precision),
        precision=precision,
        served=_servers(cfg, student, teachers, teacher_max),
    )


def _servers(
    cfg: TrainConfig, student: Tokenizer, teachers: list[Tokenizer], teacher_max: list[int]
) -> list:
    """Each served teacher's server, checked against its tokenizer and the largest k and the
    longest row its losses need, off-policy (the shards' rows) and on-policy (the rollouts'):
    `open_served`; None for the others."""
    out: list[dict | None] = []
    off_modes = cfg.teacher_modes() if cfg.kd_enabled else [None] * len(teachers)
    on_modes = cfg.onpolicy.modes(len(teachers)) if cfg.onpolicy.enabled else []
    for i, (t_cfg, tok) in enumerate(zip(cfg.teachers, teachers)):
        if not (t_cfg.server and t_cfg.weight > 0):
            out.append(None)
            continue
        need = []  # (k, longest row) per use of this teacher
        if off_modes[i] is not None:
            need.append((getattr(cfg.loss.mode_options(off_modes[i]), "k", 1), teacher_max[i]))
        if cfg.onpolicy.enabled:
            from trainer.onpolicy.teachers import rollout_max_len, view_len

            options = cfg.onpolicy.mode_options(on_modes[i], cfg.loss.temperature)
            rows = rollout_max_len(cfg)
            rows = rows if tok.fingerprint == student.fingerprint else view_len(rows)
            need.append((getattr(options, "k", 1), rows))
        if not need:
            out.append(None)
            continue
        k, max_len = max(n[0] for n in need), max(n[1] for n in need)
        out.append(open_served(t_cfg, index=i, tokenizer=tok, k=k, max_len=max_len))
    return out


def _caches(
    cfg: TrainConfig, teachers: list[Tokenizer], shards: ShardSet, *, precision: Precision
) -> list:
    """Each teacher's offline cache, checked against the shards, the teacher and its loss (a
    teacher without one, or whose term is off, gets None)."""
    out = []
    for i, (t_cfg, tok, mode) in enumerate(zip(cfg.teachers, teachers, cfg.teacher_modes())):
        if not (t_cfg.cache and cfg.kd_enabled and t_cfg.weight > 0):
            out.append(None)
            continue
        options = cfg.loss.mode_options(mode)
        out.append(
            open_teacher_cache(
                t_cfg,
                index=i,
                mode=mode,
                options=options,
                tokenizer=tok.info(),
                shards=shards,
                verify=cfg.data.verify,
                dtype=precision.teacher_dtypes[i],
            )
        )
    return out
