"""A teacher read from an offline cache (``teachers[i].cache``) instead of run.

The third source of teacher outputs behind the feed, beside the worker process and the
in-process teacher: no process, no ring, no weights. Rows are read by the microbatch's global
shard rows, so any shuffle, data-parallel split and resume point read the right ones; the
preflight checks the cache against the run before any model loads (`open_teacher_cache`;
docs/training.md, "Teacher cache").

Legend: B rows, U teacher positions, K top-k.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenbridge.formats import value_checks
from tokenbridge.formats.fingerprints import weights_fingerprint
from tokenbridge.formats.shard_schema import TokenizerInfo
from tokenbridge.formats.shards import ShardSet
from tokenbridge.formats.teacher_cache import CacheMeta
from tokenbridge.formats.teacher_cache_reader import (
    REBUILD,
    CacheMismatchError,
    CacheSet,
    Expected,
    open_cache,
)
from tokenbridge.losses.modes import MODES
from tokenbridge.teacher.outputs import TeacherOutputSpec, allocate_teacher_outputs
from trainer.config.schema import TeacherConfig


def check_spec(meta: CacheMeta, spec: TeacherOutputSpec, *, where: str, mode: str) -> None:
    """CacheMismatchError unless the cache holds every field `spec` asks for, as asked."""
    if spec.columns or spec.rest_sorted:
        raise CacheMismatchError(f"{where}: {mode} reads teacher columns, which no cache stores")
    if spec.topk and spec.topk != meta.k:
        raise CacheMismatchError(
            f"{where}: the cache holds the top-{meta.k}, {mode} asks for k={spec.topk}; "
            f"set loss.options.k={meta.k}, or rebuild the cache with K={spec.topk}"
        )
    if spec.topk and spec.temperature != meta.temperature:
        raise CacheMismatchError(
            f"{where}: the cache holds log-probs at temperature {meta.temperature}, {mode} "
            f"uses {spec.temperature}; rebuild the cache with --temperature {spec.temperature}"
        )
    if spec.target and not meta.target:
        raise CacheMismatchError(
            f"{where}: {mode} reads the target log-probs (chunk chains), this cache was built "
            "without them (--no-target); rebuild the cache without --no-target"
        )


def open_teacher_cache(
    t_cfg: TeacherConfig,
    *,
    index: int,
    mode: str,
    options,
    tokenizer: TokenizerInfo,
    shards: ShardSet,
    verify: str = "first_open",
    dtype: str,
) -> CacheSet:
    """Teacher `index`'s cache, checked for this run: complete, built from these shards and this
    teacher (tokenizer, weights, compute dtype), holding what the mode's teacher spec asks for
    (k, temperature, target log-probs); its files' checksums too unless `verify`
    (``data.verify``) is ``never``. `dtype`: the teacher's compute
    dtype on this run's device (``teachers[i].dtype`` resolved, `trainer.config.precision`),
    which the cache must have been built with."""
    where = f"teachers[{index}].cache"
    record = MODES[mode]
    # a mode that can read a cache builds its teacher spec without tables (`LossMode.no_cache`;
    # the config refused a mode that cannot, `trainer.config.rules`)
    spec = record.teacher_spec(options, None, teacher_vocab_size=tokenizer.vocab_size)
    weights = weights_fingerprint(
        t_cfg.path, init=t_cfg.init, seed=t_cfg.seed, overrides=dict(t_cfg.overrides)
    )
    expected = Expected(shards, index, tokenizer=tokenizer, weights=weights, where=where)
    cache = open_cache(t_cfg.cache, expected, verify=verify)
    check_dtype(cache.meta, dtype, index=index, named=t_cfg.dtype, cache=t_cfg.cache)
    check_spec(cache.meta, spec, where=where, mode=mode)
    return cache


def check_dtype(meta: CacheMeta, dtype: str, *, index: int, named: str, cache) -> None:
    """CacheMismatchError unless the cache's teacher ran in `dtype` (the run's, resolved from
    `named`, the config's ``teachers[i].dtype``, auto included): the message says how to match."""
    built = meta.teacher["dtype"]
    if built == dtype:
        return
    why = f" (teachers[{index}].dtype=auto on this device)" if named == "auto" else ""
    raise CacheMismatchError(
        f"teachers[{index}].cache={cache}: built with teacher dtype {built}, the run uses "
        f"{dtype}{why}; set teachers[{index}].dtype={built} to read it, or {REBUILD} "
        f"CACHE_ARGS='--teacher-dtype {dtype}'"
    )


@dataclass(eq=False)
class CachedReceived:
    """A microbatch's outputs read from the cache (the channel's `Received`, minus the slot:
    the tensors are the caller's, so releasing is a no-op)."""

    outputs: dict[str, torch.Tensor]
    teacher_s: float  # seconds spent reading and decoding
    seq: int = 0
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        self._released = True

    def __enter__(self) -> CachedReceived:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CachedTeacher:
    """One KD term's teacher outputs, read from its cache in the order microbatches come."""

    kind = "teacher cache"
    depth = None  # never limits how far live teachers run ahead

    def __init__(self, cache: CacheSet, spec: TeacherOutputSpec, *, index: int, device):
        self.cache, self.spec, self.index = cache, spec, index
        self.device = torch.device(device)
        self._pending: deque[tuple[list[int], list[int], int]] = deque()
        self._seq = 0

    def submit(self, mb, prep=None) -> None:
        """Remember the microbatch's rows (read on `receive`, in submission order); every
        position is stored, so the term's preparation (its used positions) is not needed."""
        a = mb.aligned[self.index]
        self._pending.append((list(mb.rows), a.teacher_len.tolist(), int(a.teacher_ids.shape[1])))

    def receive(self) -> CachedReceived:
        t0 = time.perf_counter()
        rows, lens, u_max = self._pending.popleft()
        outs = self.read(rows, lens, u_max)
        self._seq += 1
        return CachedReceived(outs, time.perf_counter() - t0, self._seq - 1)

    def read(self, rows: list[int], lens: list[int], u_max: int) -> dict[str, torch.Tensor]:
        """The spec's fields [B, U_max, ...] for global shard `rows` (teacher lengths `lens`)."""
        spec = self.spec
        out = allocate_teacher_outputs(spec, len(rows), u_max)
        # padding past a row's end: an empty distribution (no top-k slot, all mass in the tail,
        # target 0); the losses never read it
        if spec.topk:
            out.topk_ids.fill_(-1)
            out.topk_logprobs.fill_(float("-inf"))
        for b, (g, n) in enumerate(zip(rows, lens)):
            got = self.cache.read(g)
            f = int(self.cache.file_of[g])
            value_checks.check_cached_row(
                got, vocab_size=spec.vocab_size, where=str(self.cache.files[f]),
                row=int(self.cache.row_of[g]),
            )  # fmt: skip
            u = got.tail_logprob.shape[0]
            if u != n:
                raise CacheMismatchError(
                    f"{self.cache.where(g)}: {u} positions cached for a shard row of {n} teacher "
                    f"tokens (global row {g}); the cache does not match the shards: {REBUILD}"
                )
            if spec.topk:
                out.topk_ids[b, :u] = torch.from_numpy(got.topk_ids)
                out.topk_logprobs[b, :u] = torch.from_numpy(got.topk_logprobs)
                out.tail_logprob[b, :u] = torch.from_numpy(got.tail_logprob)
            if spec.target:
                out.target_logprob[b, :u] = torch.from_numpy(got.target_logprob)
        return {k: v.to(self.device) for k, v in out.tensors().items()}

    def close(self) -> None:
        self._pending.clear()
