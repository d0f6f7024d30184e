"""Launch helpers: spawn N local processes with a real process group, and build TP x CP x DP groups.

Starting torch in a process costs seconds here, so tests and benchmarks start one group of
processes and run many cases inside it: `spawn` returns every rank's result (a failing rank
raises here with its traceback), and `build_parallel_groups` lets several layouts live in one
launch.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenbridge import atomic
from trainer.parallel.mesh import ParallelGroups


def _worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    tmp: str,
    backend: str,
    timeout_s: float,
    threads: int,
) -> None:
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        path = Path(tmp) / f"rank{rank}.pkl"
        atomic.write(path, pickle.dumps(result), fsync=False, tmp=path.with_suffix(".tmp"))
    finally:
        dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    timeout_s: float = 120.0,
    threads: int = 1,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh processes (start method "spawn",
    the default process group initialised through a file store); return their (picklable)
    results.

    `fn` must be importable by module path (a module-level function). `timeout_s` bounds every
    collective, so a rank that diverges fails the launch instead of hanging it.
    """
    with tempfile.TemporaryDirectory(prefix="tb-spawn-") as tmp:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        mp.start_processes(
            _worker,
            args=(fn, world_size, args, tmp, backend, timeout_s, threads),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [pickle.loads((Path(tmp) / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def layout_rank(tp_i: int, cp_i: int, dp_i: int, *, tp: int, cp: int) -> int:
    """Global rank of mesh coordinate (tp_i, cp_i, dp_i); TP varies fastest."""
    return (dp_i * cp + cp_i) * tp + tp_i


def build_parallel_groups(*, tp: int, cp: int, dp: int) -> ParallelGroups | None:
    """Subgroups of the TP x CP x DP layout over ranks [0, tp * cp * dp) of the default group.

    Collective over the whole default group (``new_group`` is): ranks outside the layout call it
    too. Returns this rank's groups (`None` for a size-1 dimension), or `None` when this rank
    is outside the layout. TP varies fastest (`layout_rank`), as in Megatron's and torchtitan's
    meshes.
    """
    world = dist.get_world_size()
    need = tp * cp * dp
    if need > world:
        raise ValueError(f"layout tp={tp} x cp={cp} x dp={dp} needs {need} ranks, have {world}")
    me = dist.get_rank()
    mine: dict[str, Any] = {"tp": None, "cp": None, "dp": None}
    coords = [(t, c, d) for d in range(dp) for c in range(cp) for t in range(tp)]

    def make(name: str, size: int, members_of: Callable[[int, int, int], list[int]]) -> None:
        if size == 1:
            return
        seen: set[tuple[int, ...]] = set()
        for t, c, d in coords:
            ranks = tuple(members_of(t, c, d))
            if ranks in seen:
                continue
            seen.add(ranks)
            group = dist.new_group(list(ranks))  # every process calls, in the same order
            if me in ranks:
                mine[name] = group

    make("tp", tp, lambda t, c, d: [layout_rank(i, c, d, tp=tp, cp=cp) for i in range(tp)])
    make("cp", cp, lambda t, c, d: [layout_rank(t, i, d, tp=tp, cp=cp) for i in range(cp)])
    make("dp", dp, lambda t, c, d: [layout_rank(t, c, i, tp=tp, cp=cp) for i in range(dp)])
    if me >= need:
        return None
    return ParallelGroups(tp=mine["tp"], cp=mine["cp"], dp=mine["dp"])
