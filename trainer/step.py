"""One training step, for any source of microbatches: shard batches and on-policy rollouts.

`TrainStep.run(source)` is the one place a run's optimizer, LR schedule, step count and token
count change. A source hands over its counts, each microbatch's raw loss terms (local sum and
count) and how its terms combine; the step takes the global counts before the first backward,
normalises every term by them, clips, reads everything the guard and the log need in one
transfer, then applies the update or refuses it (docs/training.md, "A step").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenbridge.dist_ops.collectives import group_size
from tokenbridge.losses.base import LossOutput, normalize
from trainer.checkpoint import checkpointer
from trainer.config.schema import OptimConfig
from trainer.parallel import parallelize
from trainer.parallel.mesh import ParallelGroups
from trainer.run_log import (
    NonFiniteError,
    StepNumbers,
    nonfinite_message,
    nonfinite_terms,
    read_step,
)


@dataclass
class Terms:
    """One microbatch's loss terms as the losses return them: local sums and counts."""

    ce: LossOutput | None  # None: the source has no CE term (on-policy steps)
    kd: list[LossOutput]  # one per KD term, in `Source.kd_names` order
    metric_sums: dict[str, torch.Tensor] = field(default_factory=dict)  # "<term>/<x>_sum"


class Source:
    """A source of one step's microbatches for `TrainStep.run`: its counts, each microbatch's
    raw terms, how they combine, and its record of a logging step.

    A subclass sets ``kd_names`` and ``kd_modes`` (its KD terms, which the guard and the count
    check name) and implements `start`, `__len__`, `microbatch`, `combine`, `rows` and `record`.
    """

    kd_names: list[str]
    kd_modes: list[str]
    # the names of the losses' metric sums may differ between ranks (xtoken has a chain sum only
    # where multi-token chunks occurred): swap them on logging steps
    swap_sum_names: bool = False

    def start(self) -> tuple[torch.Tensor, list[list[int]]]:
        """This rank's counts ``[ce, kd_0.., tokens]`` over the step (float64, on the device;
        ce 0 without a CE term) and each microbatch's KD pre-counts (host ints)."""
        raise NotImplementedError

    def __len__(self) -> int:
        """The step's microbatches on this rank (the same number on every rank)."""
        raise NotImplementedError

    def microbatch(self, i: int) -> contextlib.AbstractContextManager[Terms]:
        """The student's forward on the step's microbatch `i` (handed out in order) and its raw
        terms. What they read (a teacher's ring slot) stays held until the context exits, after
        the backward."""
        raise NotImplementedError

    def combine(self, ce: torch.Tensor | None, kd: list[torch.Tensor]) -> torch.Tensor:
        """The loss to backward from the normalised terms (``ce`` None without a CE term)."""
        raise NotImplementedError

    def rows(self) -> list:
        """This rank's rows of the step, as the count-mismatch error names them."""
        raise NotImplementedError

    def step_sums(self) -> dict[str, float]:
        """The source's own additive numbers of a logging step, reduced and read with the
        step's (`StepNumbers.source_sums`)."""
        return {}

    def after(self, nums: StepNumbers, *, applied: bool) -> None:
        """Called after the update (``applied``: not skipped by the guard)."""

    def record(self, nums: StepNumbers, *, lr: float, step_s: float) -> dict[str, float]:
        """The logged record of a logging step from its global numbers."""
        raise NotImplementedError


def count_mismatch(*, name: str, mode: str, missed: float, count: float, step: int, rows) -> str:
    """The one message of a KD term whose loss counted other terms than its pre-count."""
    return (
        f"step {step}: KD term {name} ({mode}) counted {int(missed)} terms more or fewer than "
        f"the pre-count of {int(count)} the step was divided by (this rank's rows {rows})"
    )


class TrainStep:
    """The training step of one rank: owns the step and token counters (see the module doc).

    ``say``: prints a line on rank 0 (a skipped non-finite step); ``checkpoints``: the folder
    whose newest checkpoint the non-finite error names."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        mesh: ParallelGroups,
        replicated_grads: list[str],
        optim: OptimConfig,
        checkpoints: Path,
        device: torch.device,
        say: Callable[[str], None],
    ):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.mesh, self.replicated_grads, self.optim = mesh, replicated_grads, optim
        self.checkpoints, self.device, self.say = checkpoints, device, say
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # non-finite steps skipped (optim.skip_nonfinite)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])

    def run(self, source: Source, *, log: bool) -> dict[str, float] | None:
        """One optimizer step over the source's microbatches on every rank; its record on a
        logging step, else None."""
        t0 = time.perf_counter()
        n_mb, n_kd = len(source), len(source.kd_names)
        local, precounts = source.start()
        counts = self.mesh.sum_over_tokens_(local)  # over dp and cp, never tp (`normalize`)
        shares = torch.zeros(2 + 2 * n_kd, dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        for i in range(n_mb):
            # reduce-scatter the gradients once per step, after the last microbatch
            self.model.set_requires_gradient_sync(i == n_mb - 1)
            part, more = self.forward_backward_step(
                source, i, counts=counts[:-1], precounts=precounts[i]
            )
            shares += part
            for k, v in more.items() if log else ():
                sums[k] = sums[k] + v.double() if k in sums else v.double()
        parallelize.sync_replicated_grads(self.model, self.replicated_grads, self.mesh.tp)
        grad_norm = parallelize.clip_grad_norm_(list(self.model.parameters()), self.optim.grad_clip)
        names = self._sum_names(sums, swap=source.swap_sum_names) if log else []
        extra = source.step_sums() if log else {}
        shares = self._with_sums(shares, [sums.get(k) for k in names], extra)
        self.mesh.sum_over_tokens_(shares)
        # the step's one read to the host: the guard needs the losses and the norm before the
        # optimizer step, and the norm is computed for clipping anyway
        nums = read_step(shares, counts, grad_norm, n_terms=n_kd, names=names, extra=list(extra))
        self._check_counts(nums, source)
        lr = self.scheduler.get_last_lr()[0]
        applied = self._apply_or_guard(nums, terms=source.kd_names)
        self.step += 1
        self.tokens_seen += int(nums.counts[-1])
        source.after(nums, applied=applied)
        if not log:
            return None
        return source.record(nums, lr=lr, step_s=time.perf_counter() - t0)

    def forward_backward_step(
        self, source: Source, i: int, *, counts: torch.Tensor, precounts: list[int]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of the source's microbatch `i`, with no host sync. ``counts``:
        the global ``[ce, kd_0..]``. Returns, detached, ``[ce, kd_0.., total, missed_0..]``
        (each term's share of the step loss; each KD term's |count - pre-count|) and the
        losses' metric sums."""
        with source.microbatch(i) as terms:
            ce = normalize(terms.ce, counts[0]) if terms.ce is not None else None
            kd = [normalize(out, counts[1 + j]) for j, out in enumerate(terms.kd)]
            total = source.combine(ce, kd)
            total.backward()
        # the step was divided by the pre-counts, so a loss that counts otherwise would be
        # scaled wrongly; kept on the device and checked once per step (`_check_counts`):
        # `int(out.count)` here would wait for the device on every microbatch
        missed = [(out.count - c).abs().double() for out, c in zip(terms.kd, precounts)]
        ce_share = ce.detach() if ce is not None else counts.new_zeros(())
        parts = [ce_share, *(v.detach() for v in kd), total.detach(), *missed]
        return torch.stack(parts).double(), terms.metric_sums

    def _sum_names(self, sums: dict[str, torch.Tensor], *, swap: bool) -> list[str]:
        """The names of the losses' metric sums on any dp or cp rank, in one order; swapped as
        host objects on logging steps only, then reduced with the losses in one all-reduce."""
        n = group_size(self.mesh.dp_cp)
        if not swap or n == 1:
            return sorted(sums)
        every: list[list[str]] = [[] for _ in range(n)]
        dist.all_gather_object(every, sorted(sums), group=self.mesh.dp_cp)
        return sorted(set().union(*every))

    def _with_sums(
        self, shares: torch.Tensor, sums: list[torch.Tensor | None], extra: dict[str, float]
    ) -> torch.Tensor:
        """``shares`` followed by the metric sums (zero where this rank has none) and the
        source's own sums: one tensor, for one all-reduce and one read."""
        parts = [shares]
        if sums:
            zero = shares.new_zeros(())
            parts.append(torch.stack([zero if v is None else v for v in sums]))
        if extra:
            parts.append(torch.tensor(list(extra.values()), dtype=torch.float64).to(self.device))
        return torch.cat(parts) if len(parts) > 1 else shares

    def _check_counts(self, nums: StepNumbers, source: Source) -> None:
        """Every KD term counted what its pre-count said (over the step and all ranks: every
        rank raises alike)."""
        named = zip(source.kd_names, source.kd_modes, nums.missed, nums.counts[1:-1])
        for name, mode, missed, count in named:
            if missed:
                raise RuntimeError(
                    count_mismatch(
                        name=name,
                        mode=mode,
                        missed=missed,
                        count=count,
                        step=self.step + 1,
                        rows=source.rows(),
                    )  # fmt: skip
                )

    def _apply_or_guard(self, nums: StepNumbers, *, terms: list[str]) -> bool:
        """The optimizer step, unless a loss term or the gradient norm is not finite: then stop
        (NonFiniteError), or with optim.skip_nonfinite drop the gradients and go on (the data
        is consumed, the LR schedule advances). Every rank holds the same reduced numbers, so
        every rank decides alike. True when applied. ``terms``: the KD terms' names."""
        found = nonfinite_terms(nums.losses, terms=terms, grad_norm=nums.grad_norm)
        if found and not self.optim.skip_nonfinite:
            last = checkpointer.list_checkpoints(self.checkpoints)
            last_good = last[-1][1] if last else None
            raise NonFiniteError(nonfinite_message(self.step + 1, found, last_checkpoint=last_good))
        if found:
            self.skipped_steps += 1
            self.say(
                f"step {self.step + 1}: non-finite {', '.join(found)}: skipped, no update "
                f"(optim.skip_nonfinite; {self.skipped_steps} so far)"
            )
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return not found
