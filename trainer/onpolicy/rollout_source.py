"""Rollouts as a source of microbatches for the one training step (`trainer.step`).

An on-policy step's rollouts (sampled, aligned, scored) give the step their counts, the
student's forward on whole rows and each teacher's term, summed or taken on the mixture of
same-tokenizer teachers. No CE: the student's likelihood of its own samples is not a target.

Legend: B rollouts in a microbatch, T student positions, V student lm_head width.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

from tokenbridge.losses.multi_teacher import combine_teachers
from tokenbridge.losses.opd import mix_teacher_outputs
from trainer.data.microbatches import MicrobatchLoader
from trainer.loss_terms import KDTerm
from trainer.onpolicy.importance import RATIO_STATS, policy_logprobs, prefix_weights, scale_grad
from trainer.onpolicy.packed_rollouts import rollout_logits
from trainer.onpolicy.sampling.sampler import Rollouts, SamplingConfig
from trainer.run_log import StepNumbers, peak_memory_gib
from trainer.step import Source, Terms


class RolloutSource(Source):
    """One on-policy step's rollouts as the one step's microbatches (`trainer.step.Source`).
    ``batches``: `OnPolicy.batches` of ``r``; ``outs``: the teachers' outputs per microbatch;
    ``terms``: the teachers' KD terms, ``weights`` theirs (one, on their ``mixture``);
    ``sampling``: what the rollouts were drawn with, ``ratio_clip`` the cap on an int8
    sample's ratio weight; ``loader``: the shard side's (the epoch the record shows)."""

    def __init__(
        self,
        r: Rollouts,
        batches: list,
        outs: list,
        *,
        model: torch.nn.Module,
        terms: list[KDTerm],
        mixture: bool,
        weights: torch.Tensor,
        sampling: SamplingConfig,
        ratio_clip: float,
        logits_chunk: int,
        tp_group,
        vocab_size: int,
        loader: MicrobatchLoader,
        device: torch.device,
    ):
        self.r, self.batches, self.outs = r, batches, outs
        self.model, self.teachers, self.mixture, self.weights = model, terms, mixture, weights
        self.sampling, self.ratio_clip = sampling, ratio_clip
        self.logits_chunk, self.tp_group, self.vocab_size = logits_chunk, tp_group, vocab_size
        self.loader, self.device = loader, device
        self.terms = terms[:1] if mixture else terms  # the mixture: one term, the first's mode
        self.kd_names = ["mixture"] if mixture else [t.name for t in terms]
        self.kd_modes = [t.mode for t in self.terms]
        # the ratio weights' sums over this step's microbatches (int8 sampling only)
        self.ratio = Counter()

    def __len__(self) -> int:
        return len(self.batches)

    def start(self) -> tuple[torch.Tensor, list[list[int]]]:
        n = len(self.terms)
        local = torch.zeros(n + 2, dtype=torch.float64, device=self.device)  # no CE: 0
        precounts = []
        for b, preps in self.batches:
            pre = [t.count(preps[j]) for j, t in enumerate(self.terms)]
            precounts.append(pre)
            for j in range(n):
                local[1 + j] += pre[j]
            local[-1] += b.attention_mask_BT.sum()
        return local, precounts

    @contextlib.contextmanager
    def microbatch(self, i: int) -> Iterator[Terms]:
        b, preps = self.batches[i]
        # whole vocabulary under TP (the on-policy losses are not vocab-parallel): every TP
        # rank computes the same loss. With parallel.logits_chunk, projected block by block.
        # Packed rollouts (data.packing): the forward on the packed rows, laid back per rollout
        logits_BTV = rollout_logits(self.model, b, chunk=self.logits_chunk, tp_group=self.tp_group)
        if b.behaviour_BT is not None:
            logits_BTV = self._weigh(logits_BTV, b)
        if self.mixture:
            raw = [t.weight for t in self.teachers]
            mixed = mix_teacher_outputs(self.outs[i], raw)
            kd = [self.terms[0].loss(logits_BTV, mixed, preps[0])]
        else:
            kd = [t.loss(logits_BTV, self.outs[i][j], preps[j]) for j, t in enumerate(self.terms)]
        yield Terms(None, kd)

    def _weigh(self, logits_BTV, b):
        """The logits with each position's gradient weighted by its state's likelihood ratio
        (`importance`)."""
        target = policy_logprobs(
            logits_BTV, b.targets_BT, config=self.sampling, vocab=self.vocab_size
        )
        w_BT, stats = prefix_weights(target, b.behaviour_BT, b.targets_BT, clip=self.ratio_clip)
        n = int((b.targets_BT >= 0).sum())
        for k, v in stats.items():
            self.ratio[k] += v * n
        self.ratio["n"] += n
        return scale_grad(logits_BTV, w_BT)

    def combine(self, ce: torch.Tensor | None, kd: list[torch.Tensor]) -> torch.Tensor:
        return combine_teachers(kd, self.weights)[0]

    def rows(self) -> list:
        return [m["key"] for m in self.r.meta]

    def _stat_names(self) -> list[str]:
        names = ["rollouts", "new_tokens", "stopped", "positions"]
        for t in self.teachers:
            names += [f"dropped/{t.name}", f"chunks_boundary/{t.name}", f"chunks_invalid/{t.name}"]
        if self.sampling.records_logprobs:
            names += [*RATIO_STATS, "ratio/n"]
        return names

    def step_sums(self) -> dict[str, float]:
        r, batches = self.r, self.batches
        # the positions the student's forward computes: its padded rows, or its packed ones
        positions = sum(b.input_ids_BT.numel() if b.packed is None else b.packed.positions
                        for b, _ in batches)  # fmt: skip
        vals = [len(r), r.new_tokens, sum(r.stopped), positions]
        for j in range(len(self.teachers)):
            vals += [
                sum(sum(b.drops[j].values()) for b, _ in batches),
                sum(b.chunk_drops[j]["boundary"] for b, _ in batches),
                sum(b.chunk_drops[j]["invalid_utf8"] for b, _ in batches),
            ]
        if self.sampling.records_logprobs:
            vals += [self.ratio[k] for k in RATIO_STATS] + [self.ratio["n"]]
        return dict(zip(self._stat_names(), vals))

    def record(self, nums: StepNumbers, *, lr: float, step_s: float) -> dict[str, float]:
        """The on-policy record (`OnPolicy.step` adds its timings and ``step_s``)."""
        total, stats, counts = nums.losses[-1], dict(nums.source_sums), nums.counts[1:]
        m = {"loss": total, "kd": total, "grad_norm": nums.grad_norm, "lr": lr}
        for name, v, c in zip(self.kd_names, nums.losses[1:-1], counts):
            m[f"kd/{name}"] = v
            m[f"coverage/{name}"] = c / max(1.0, stats["new_tokens"])  # terms per sampled token
        n = max(1.0, stats["rollouts"])
        m.update(stats)
        m["rollout/len_mean"] = m.pop("new_tokens") / n
        m["rollout/stopped_frac"] = m.pop("stopped") / n
        m["rollout/count"] = m.pop("rollouts")
        if "ratio/n" in m:  # sums over positions (and ranks) -> means
            n = max(1.0, m.pop("ratio/n"))
            m.update({k: m[k] / n for k in RATIO_STATS})
        # padding: the share of the positions the student computed that hold no token
        positions = m.pop("positions")
        m["padding_fraction"] = 1.0 - counts[-1] / positions if positions else 0.0
        m.update(
            tokens=int(counts[-1]),
            memory_gib=peak_memory_gib(self.device),
            epoch=self.loader.epoch,
        )
        return m
