"""Shard batches as a source of microbatches for the one training step (`trainer.step`).

The off-policy side of a run: ``data.grad_accum`` microbatches of the aligned shards per step,
drawn through the teacher feed (the teachers run ahead; a microbatch's ring slots are held until
its backward is done), each giving the student's CE and every teacher's KD term on this rank's
positions (CP) and vocabulary shard (TP).

Legend: B rows, T student positions, L = T / cp of them on this rank, V student vocabulary
(lm_head width; V / tp of it on this rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from statistics import fmean

import torch

from tokenbridge.dist_ops import CPContext
from tokenbridge.losses.ops.head_logits import HeadLogits
from tokenbridge.teacher.outputs import TeacherOutputs
from trainer.config.schema import DataConfig, LossConfig, ParallelConfig
from trainer.data.microbatches import IGNORE, Microbatch, MicrobatchLoader
from trainer.loss_terms import KDTerm, ce_term, combine_terms, kd_weights
from trainer.parallel.cp_attention import model_inputs
from trainer.parallel.head import student_logits
from trainer.parallel.mesh import ParallelGroups
from trainer.run_log import StepNumbers, peak_memory_gib, train_metrics, weighted_kd
from trainer.step import Source, Terms
from trainer.teacher.dispatch import Feed, Queued
from trainer.teacher.ring import shm_mappings
from trainer.throughput import Throughput


def shm_usage() -> dict[str, float]:
    """The shared-memory segments this process maps (teacher channel rings; their names are
    unlinked once the worker maps them, so /dev/shm does not list them): count and bytes.
    Constant over a run when slots are reused, never re-allocated."""
    maps = shm_mappings()
    return {"shm_segments": len(maps), "shm_bytes": sum(maps.values())}


class ShardSource(Source):
    """The shard batches of a run, a step at a time: `start` takes the next ``data.grad_accum``
    microbatches from the teacher ``feed`` (drawn from ``loader``); `microbatch` runs the
    student's ``model`` on one (`student_logits`) and every KD term in ``terms`` on its
    teachers' outputs. ``vocab_size``: the student tokenizer's (lm_head columns past it are
    masked); ``throughput``: the run's per-device rates (`trainer.throughput`)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        terms: list[KDTerm],
        feed: Feed,
        loader: MicrobatchLoader,
        mesh: ParallelGroups,
        data: DataConfig,
        loss: LossConfig,
        parallel: ParallelConfig,
        vocab_size: int,
        throughput: Throughput,
        device: torch.device,
    ):
        self.model, self.terms, self.feed, self.loader = model, terms, feed, loader
        self.mesh, self.data, self.loss, self.parallel = mesh, data, loss, parallel
        self.vocab_size, self.throughput, self.device = vocab_size, throughput, device
        self.kd_names = [t.name for t in self.terms]
        self.kd_modes = [t.mode for t in self.terms]
        self.swap_sum_names = bool(self.terms)
        weights = kd_weights(self.terms) if self.terms else None
        self.weight_list = weights.tolist() if weights is not None else []
        # on the device once: a host tensor would be copied over (a sync) every microbatch
        self.weights = weights.to(device) if weights is not None else None
        self.combine_config = loss.combine_config()  # built once: the step reads no config code
        self.scale: float | None = None  # dynamic combine: last applied step's |CE| / |KD|
        self.queued: list[Queued] = []
        self.teacher_s = 0.0

    def __len__(self) -> int:
        return self.data.grad_accum

    def cp_context(self, mb: Microbatch) -> CPContext | None:
        """What the losses need to know of this rank's CP share of `mb` (None at cp = 1)."""
        if self.mesh.cp_size == 1:
            return None
        return CPContext(self.mesh.cp, mb.input_ids_BT.shape[1])

    def forward(self, mb: Microbatch) -> torch.Tensor | HeadLogits:
        """The student's logits on this rank, [B, L, V / tp]: its CP positions of every row
        (global position ids) and its TP shard of the vocabulary; with
        ``parallel.logits_chunk`` (the default) a `HeadLogits`, never whole
        (`trainer.parallel.head.student_logits`)."""
        rows = mb.student_rows(cp_size=self.mesh.cp_size, cp_rank=self.mesh.cp_rank)
        inputs = model_inputs(rows, group=self.mesh.cp)
        return student_logits(
            self.model, inputs, chunk=self.parallel.logits_chunk, tp_group=self.mesh.tp
        )

    def start(self) -> tuple[torch.Tensor, list[list[int]]]:
        self.queued = self.feed.peek(len(self))  # loaded and prepared, not yet received
        # each rank counts the positions and chunk terms it computes (its CP share), so the sum
        # over dp and cp is the global count; TP ranks count alike and are never summed
        self.teacher_s = 0.0
        cps = [self.cp_context(q.mb) for q in self.queued]
        pre = [
            [t.count(p, cp) for t, p in zip(self.terms, q.prep)] for q, cp in zip(self.queued, cps)
        ]
        local = torch.zeros(2 + len(self.terms), dtype=torch.float64, device=self.device)

        def mine(x_BT: torch.Tensor, cp: CPContext | None) -> torch.Tensor:
            return x_BT if cp is None else cp.shard(x_BT)

        local[0] = sum(
            (mine(q.mb.targets_BT, cp) != IGNORE).sum() for q, cp in zip(self.queued, cps)
        )
        for j in range(len(self.terms)):
            # a scalar fill: copying a host tensor over would wait for the device
            local[1 + j] = sum(row[j] for row in pre)
        local[-1] = sum(mine(q.mb.attention_mask_BT, cp).sum() for q, cp in zip(self.queued, cps))
        return local, pre

    @contextlib.contextmanager
    def microbatch(self, i: int) -> Iterator[Terms]:
        q, received = self.feed.next()
        try:
            outs = [TeacherOutputs(**r.outputs) for r in received]
            self.teacher_s += sum(r.teacher_s for r in received)
            yield self._terms(q, outs)
        finally:
            for r in received:
                r.release()

    def _terms(self, q: Queued, teacher_outputs: list[TeacherOutputs]) -> Terms:
        mb = q.mb
        logits_BLV = self.forward(mb)
        par = {"tp_group": self.mesh.tp, "cp": self.cp_context(mb)}
        vocab = self.vocab_size
        if self.terms and self.loss.ce_weight == 0:
            with torch.no_grad():  # CE is always reported, but needs no graph here
                ce_out = ce_term(logits_BLV.detach(), mb, vocab_size=vocab, **par)
        else:
            ce_out = ce_term(logits_BLV, mb, vocab_size=vocab, **par)
        kd_outs = [
            term.loss(logits_BLV, outs, q.prep[i], **par)
            for i, (term, outs) in enumerate(zip(self.terms, teacher_outputs))
        ]
        sums = {
            f"{term.name}/{k}": v
            for term, out in zip(self.terms, kd_outs)
            for k, v in out.metrics.items()
            if k.endswith("_sum")  # the ones logged (as means per KD term)
        }
        return Terms(ce_out, kd_outs, sums)

    def combine(self, ce: torch.Tensor | None, kd: list[torch.Tensor]) -> torch.Tensor:
        return combine_terms(self.combine_config, ce, kd, weights=self.weights, scale=self.scale)

    def rows(self) -> list:
        return [r for q in self.queued for r in q.mb.rows]

    def after(self, nums: StepNumbers, *, applied: bool) -> None:
        if applied and self.terms and self.loss.combine == "dynamic":
            kd = weighted_kd(self.weight_list, nums.losses[1:-1])
            # the next step's |CE| / |KD|: a step's own totals are not known before its first
            # backward, so the dynamic scale is the previous applied step's
            self.scale = abs(nums.losses[0]) / max(abs(kd), 1e-8)

    def _live(self) -> list[KDTerm]:
        """The KD terms whose teacher runs (not read from a cache): their FLOPs count."""
        return [t for t in self.terms if t.name in self.throughput.teachers]

    def step_sums(self) -> dict[str, float]:
        """The student's positions of the step (padding included) and the live teachers'
        tokens: real (unpadded) teacher positions of this rank's microbatches, 1 / cp of them
        on each cp rank (summed over dp and cp: every row once). Read on logging steps only."""
        share = 1.0 / self.mesh.cp_size
        # the positions the student computes, padding included (shapes: no device read)
        out = {"positions": share * sum(q.mb.input_ids_BT.numel() for q in self.queued)}
        live = self._live()
        if not live:
            return out
        lens = [q.mb.aligned[t.index].teacher_len.sum() for t in live for q in self.queued]
        host = torch.stack(lens).reshape(len(live), -1).sum(1).tolist()
        return out | {f"teacher_tokens/{t.name}": n * share for t, n in zip(live, host)}

    def record(self, nums: StepNumbers, *, lr: float, step_s: float) -> dict[str, float]:
        measured = {
            **shm_usage(),
            "lr": lr,
            "step_s": step_s,
            "teacher_s": self.teacher_s,
            "memory_gib": peak_memory_gib(self.device),
            "epoch": self.loader.epoch,
        }
        m = train_metrics(nums, terms=self.kd_names, kd_weights=self.weight_list, host=measured)
        # padding: the share of the positions computed that hold no token (packed rows: the
        # tail of each row); trained tokens: the positions with a target (CE's count)
        positions = nums.source_sums.get("positions", 0.0)
        m["padding_fraction"] = 1.0 - m["tokens"] / positions if positions else 0.0
        m["trained_tokens"] = int(nums.counts[0])
        m |= self.throughput.record(
            tokens=m["tokens"],
            step_s=step_s,
            seq=fmean(q.mb.input_ids_BT.shape[1] for q in self.queued),
            teacher_tokens={
                k.removeprefix("teacher_tokens/"): v
                for k, v in nums.source_sums.items()
                if k.startswith("teacher_tokens/")
            },
            teacher_seq={
                t.name: fmean(q.mb.aligned[t.index].teacher_ids.shape[1] for q in self.queued)
                for t in self._live()
            },
        )
        return m
