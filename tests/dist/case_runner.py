"""The worker side of the one launch (`harness`): load every case module, then run the named
cases on this rank. Apart from `harness` so that the case modules, which import its `Ctx` and
`case`, are not imported by the module they import.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch.distributed as dist

from tests.dist.harness import ALL_LAYOUTS, REGISTRY, Case, Ctx
from trainer.parallel.spawn import build_parallel_groups


def load_cases() -> dict[str, Case]:
    """Import every case module (registration happens at import)."""
    from tests.dist import cases_context, cases_library, cases_loss, cases_vocab  # noqa: F401

    return REGISTRY


def run_cases(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """Worker: build every layout's groups, run the named cases; name -> error text or None."""
    cases = load_cases()
    layouts = {lay: build_parallel_groups(tp=lay[0], cp=lay[1], dp=lay[2]) for lay in ALL_LAYOUTS}
    results: dict[str, str | None] = {}
    for name in names:
        layout, fn = cases[name]
        groups = layouts[layout]
        if groups is None:  # this rank is outside the layout
            results[name] = None
            dist.barrier()
            continue
        ctx = Ctx(rank=rank, name=name, layout=layout, groups=groups)
        if os.environ.get("TB_DIST_TRACE"):  # which case a hang is in
            print(f"[rank {rank}] {time.perf_counter():.2f} {name}", file=sys.stderr, flush=True)
        try:
            fn(ctx)
        except Exception:  # noqa: BLE001 - reported per case; ranks may then time out
            ctx.errors.append(f"rank {rank} raised:\n{traceback.format_exc()}")
        results[name] = "\n".join(ctx.errors) or None
        dist.barrier()  # a slow rank never mixes its collectives with the next case's
    return results
