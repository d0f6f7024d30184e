"""One launch, many cases: the multi-process test harness for tests/dist.

Starting 4 torch processes costs ~7 s here, so the whole multi-process suite is ONE
`trainer.parallel.spawn.spawn` of 4 gloo ranks that builds every TP x CP x DP layout once and
runs every registered case in it. Each case records its mismatches instead of raising (so the
ranks stay in step through the remaining collectives), and the pytest side turns each case into
its own test item (see conftest.py). The registered cases are loaded and run by
`tests.dist.case_runner`, so no case module's import leads back here.

A case is `fn(ctx)`; ranks outside the case's layout skip it. Data is generated from a seed
derived from the case name, identically on every rank, so every rank can compute the dense
single-process reference itself and compare its own shard.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenbridge.dist_ops import to_cp_layout
from trainer.parallel.mesh import ParallelGroups

WORLD = 4
TOL = {"rtol": 1e-5, "atol": 1e-5}
Layout = tuple[int, int, int]  # (tp, cp, dp)
ALL_LAYOUTS: list[Layout] = [
    (tp, cp, dp) for tp in (1, 2, 4) for cp in (1, 2, 4) for dp in (1, 2) if tp * cp * dp <= WORLD
]


@dataclass
class Ctx:
    """What a case sees on one rank."""

    rank: int
    name: str
    layout: Layout
    groups: ParallelGroups
    errors: list[str] = field(default_factory=list)

    @property
    def tp(self) -> int:
        return self.layout[0]

    @property
    def cp(self) -> int:
        return self.layout[1]

    @property
    def dp(self) -> int:
        return self.layout[2]

    def generator(self, salt: str = "") -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{self.name}/{salt}".encode()))

    def close(self, what: str, actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
        """Record (not raise) a mismatch, so this rank keeps joining the later collectives."""
        try:
            torch.testing.assert_close(
                actual.detach(), expected.detach().to(actual.dtype), **(tol or TOL)
            )
        except AssertionError as err:
            self.errors.append(f"rank {self.rank} {what}: {err}")

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.errors.append(f"rank {self.rank} {what}")

    # -- slicing the full (single-process) tensors into this rank's shard ---------------------

    def tp_slice(self, x: torch.Tensor) -> torch.Tensor:
        v_local = x.shape[-1] // self.tp
        return x[..., self.groups.tp_rank * v_local : (self.groups.tp_rank + 1) * v_local]

    def dp_rows(self, n_rows: int) -> list[int]:
        """Uneven DP split: rank 0 gets the first ceil(n/2) rows when DP = 2."""
        if self.dp == 1:
            return list(range(n_rows))
        cut = (n_rows + 1) // 2
        return list(range(cut)) if self.groups.dp_rank == 0 else list(range(cut, n_rows))

    def local(self, x: torch.Tensor, *, vocab: bool, seq: bool = True) -> torch.Tensor:
        """[B, T, ...] full -> this rank's DP rows, CP tokens (dim 1) and, if vocab, TP slice."""
        x = x[self.dp_rows(x.shape[0])]
        if seq:
            x = to_cp_layout(x, cp_size=self.cp, cp_rank=self.groups.cp_rank, dim=1)
        return self.tp_slice(x) if vocab else x


Case = tuple[Layout, Callable[[Ctx], None]]
REGISTRY: dict[str, Case] = {}


def case(name: str, layout: Layout) -> Callable[[Callable[[Ctx], None]], Callable]:
    """Register `fn` as case `name`, run on the ranks of `layout`."""
    if layout not in ALL_LAYOUTS:
        raise ValueError(f"layout {layout} is not one of {ALL_LAYOUTS}")

    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        if name in REGISTRY:
            raise ValueError(f"duplicate case {name}")
        REGISTRY[name] = (layout, fn)
        return fn

    return deco
