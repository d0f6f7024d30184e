"""`trl_gold`: TRL 1.16's GOLD hybrid ULD loss, computed by TRL's own code inside our trainer.

Bench only (the product never imports trl or bench): importing this module registers the loss
mode, as `bench.science.trl_gold_train` does before it runs the trainer. The science table puts
TRL's loss, as TRL computes it, next to our `gold`; docs/science.md says how TRL is called and
which of its quirks are kept.

Legend: B rows, S student positions, V student width.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from tokenbridge.losses.base import LossOutput, OptionError, as_count, check_option, zero_sum_like
from tokenbridge.losses.modes import MODES, LossMode
from tokenbridge.losses.ops.cp_chunks import complete_chunks, open_chunk_loss
from tokenbridge.losses.ops.segments import AlignedBatch, ChunkIndex, ChunkSide, index_chunks
from tokenbridge.losses.ops.turns import split_chunks
from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.gold.gold_config import GOLDConfig  # noqa: E402
from trl.experimental.gold.gold_trainer import ULDLoss  # noqa: E402

NAME = "trl_gold"
# TRL's own defaults, read from its dataclass (not copied)
TRL_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(GOLDConfig)
    if f.default is not dataclasses.MISSING
}
MERGES = ("observed", "bayesian")


@dataclass(frozen=True)
class TrlGoldConfig:
    """The ULD settings of TRL's `GOLDConfig` (defaults: TRL's), and the tokenizers it matches."""

    teacher_tokenizer: str | None = None  # HF dirs; `bench.science.trl_gold_train` fills them from
    student_tokenizer: str | None = None  # teachers[0].path and model.path
    merge: str = TRL_DEFAULTS["uld_token_merge_strategy"]
    beta: float = TRL_DEFAULTS["beta"]
    matched_weight: float | None = TRL_DEFAULTS["uld_hybrid_matched_weight"]
    unmatched_weight: float | None = TRL_DEFAULTS["uld_hybrid_unmatched_weight"]
    student_temperature: float = TRL_DEFAULTS["uld_student_temperature"]
    teacher_temperature: float = TRL_DEFAULTS["uld_teacher_temperature"]

    def __post_init__(self) -> None:  # the checks of GOLDConfig.__post_init__, as OptionErrors
        check_option(self, "merge", self.merge in MERGES, f"one of {list(MERGES)}")
        check_option(self, "beta", 0.0 <= self.beta <= 1.0, "0 <= beta <= 1")
        check_option(self, "student_temperature", self.student_temperature > 0, "> 0")
        check_option(self, "teacher_temperature", self.teacher_temperature > 0, "> 0")
        if (self.matched_weight is None) != (self.unmatched_weight is None):
            unset = "unmatched_weight" if self.unmatched_weight is None else "matched_weight"
            raise OptionError("TrlGoldConfig", unset, "set both weights, or neither (adaptive)")

    @property
    def shift(self) -> int:
        """How many positions TRL's logits slice starts before the answer (1: bayesian)."""
        return 1 if self.merge == "bayesian" else 0


def build_uld(config: TrlGoldConfig, *, teacher_tok, student_tok) -> ULDLoss:
    """TRL's `ULDLoss` with TRL's defaults, the hybrid loss on and its CE off; the tokenizers
    need only ``get_vocab()`` (what TRL reads)."""
    trl_config = SimpleNamespace(**TRL_DEFAULTS)
    trl_config.use_uld_loss = True
    trl_config.uld_use_hybrid_loss = True
    trl_config.uld_crossentropy_weight = 0.0  # our loop adds the student's CE
    trl_config.uld_token_merge_strategy = config.merge
    trl_config.beta = config.beta
    trl_config.uld_hybrid_matched_weight = config.matched_weight
    trl_config.uld_hybrid_unmatched_weight = config.unmatched_weight
    trl_config.uld_student_temperature = config.student_temperature
    trl_config.uld_teacher_temperature = config.teacher_temperature
    uld = ULDLoss(trl_config, student_tokenizer=student_tok, teacher_tokenizer=teacher_tok)
    if not uld._vocab_mapping:
        raise ValueError(f"{NAME}: the tokenizers share no vocabulary string (TRL matches none)")
    return uld


@functools.lru_cache(maxsize=4)
def uld_for(config: TrlGoldConfig) -> ULDLoss:
    """`build_uld` with the HF tokenizers of ``config`` (loaded once per config)."""
    from transformers import AutoTokenizer

    if config.teacher_tokenizer is None or config.student_tokenizer is None:
        raise ValueError(
            f"{NAME}: loss.options.teacher_tokenizer / student_tokenizer are unset (HF dirs whose "
            "get_vocab() TRL matches; `python -m bench.science.trl_gold_train` fills them)"
        )
    teacher_tok = AutoTokenizer.from_pretrained(config.teacher_tokenizer)
    student_tok = AutoTokenizer.from_pretrained(config.student_tokenizer)
    return build_uld(config, teacher_tok=teacher_tok, student_tok=student_tok)


def _row_groups(side: ChunkSide, chunks: Tensor, b: int) -> tuple[int, int, list, list[int]]:
    """Row ``b``'s answer span [start, end) (its chunks' tokens, positions in the row), the
    groups as TRL takes them (positions relative to start) and the token ids on the span."""
    first = (side.first[chunks] - b * side.width).tolist()
    last = (side.last[chunks] - b * side.width).tolist()
    start, end = min(first), max(last) + 1
    groups = [list(range(f - start, z - start + 1)) for f, z in zip(first, last)]
    # the token at position p is the target of position p - 1 (start >= 1: chunks are predicted)
    flat = b * side.width
    token_ids = side.targets[flat + start - 1 : flat + end - 1].tolist()
    return start, end, groups, token_ids


def trl_gold(
    student_logits_BSV: Tensor,
    teacher: TeacherOutputs,
    index: ChunkIndex,
    *,
    uld: ULDLoss,
    vocab_size: int,
) -> LossOutput:
    """TRL's hybrid ULD loss per row over the aligned chunks (docs/science.md): sum over rows,
    count = rows (TRL averages its rows).

    TRL's cost too: per 256-token microbatch of the real pair (~200 chunks, one thread) its
    hybrid loss sorts the teacher's ~247,000 unmatched probabilities per chunk (~5 s) and its
    backward goes through one in-place row write per chunk (~11 s): ~3x gold's step on CPU."""
    _, chunks, metrics = open_chunk_loss(
        NAME, student_logits_BSV, teacher, index, None, fields=("col_logprobs",)
    )
    b_rows = student_logits_BSV.shape[0]
    shift = 1 if uld.token_merge_strategy == "bayesian" else 0
    if uld.mapping_tensor.device != student_logits_BSV.device:
        uld.mapping_tensor = uld.mapping_tensor.to(student_logits_BSV.device)
    x_BSV = student_logits_BSV[..., :vocab_size]  # columns past the tokenizer are no tokens
    total = zero_sum_like(student_logits_BSV)
    matched, unmatched = torch.zeros(()), torch.zeros(())
    rows_of = index.chunk_row[chunks]
    for b in range(b_rows):
        mine = chunks[rows_of == b]
        if mine.numel() == 0:
            continue  # TRL appends a zero loss for a row without an answer: counted, adds 0
        s0, s1, s_groups, s_ids = _row_groups(index.student, mine, b)
        t0, t1, t_groups, t_ids = _row_groups(index.teacher, mine, b)
        # TRL's lines: softmax of the answer logits (shifted for bayesian) at its temperatures
        s_probs = F.softmax(x_BSV[b, s0 - shift : s1 - shift] / uld.student_temperature, dim=-1)
        with torch.no_grad():
            t_lp = teacher.col_logprobs[b, t0 - shift : t1 - shift].float()
            t_probs = F.softmax(t_lp / uld.teacher_temperature, dim=-1)
            t_aligned = uld._merge_probabilities_with_alignment_groups(t_probs, t_groups, t_ids)
        s_aligned = uld._merge_probabilities_with_alignment_groups(s_probs, s_groups, s_ids)
        row = uld._compute_hybrid_uld_loss(s_aligned, t_aligned)
        total = total + uld.distillation_weight * row
        matched = matched + uld.last_matched_loss.detach().cpu()
        unmatched = unmatched + uld.last_unmatched_loss.detach().cpu()
    device = student_logits_BSV.device
    metrics.update(
        {
            "kd_sum": total.detach(),
            "trl_matched_sum": matched.to(device),
            "trl_unmatched_sum": unmatched.to(device),
        }
    )
    return LossOutput(total, as_count(b_rows, device), metrics)


# ---------------------------------------------------------------------------------------------
# the registry record


@dataclass(frozen=True)
class TrlTables:
    teacher_vocab_size: int

    def to(self, device) -> TrlTables:
        return self


class TrlGoldMode(LossMode):
    """``trl_gold`` as the trainer sees it: the trained text chunks, one term per row."""

    name = NAME
    options = TrlGoldConfig
    no_cache = "it reads the teacher's whole distribution (TRL's loss), which no cache stores"

    def tables(self, projection, *, teacher_vocab_size: int, student_vocab_size: int):
        return TrlTables(teacher_vocab_size)  # TRL reads no projection: it matches vocab strings

    def teacher_spec(self, options: TrlGoldConfig, tables, *, teacher_vocab_size: int):
        uld_for(options)  # load the tokenizers and TRL's mapping now: a bad path fails at startup
        # the whole distribution at the rows the loss reads, fp32: 1 MiB per position for Gemma's
        # 262,144 ids, ~270 MB per 256-token microbatch in the ring; at temperature 1, since
        # TRL's softmax of logits / T equals the softmax of these log-probs / T
        return TeacherOutputSpec(teacher_vocab_size, columns=teacher_vocab_size)

    def columns(self, tables: TrlTables) -> Tensor:
        return torch.arange(tables.teacher_vocab_size)  # the whole distribution

    def prepare(self, aligned: AlignedBatch, targets_BT: Tensor) -> ChunkIndex:
        return split_chunks(index_chunks(aligned), targets_BT).text  # trained text chunks

    def count(self, index: ChunkIndex, cp=None) -> int:
        return index.student.targets.numel() // index.student.width  # rows: TRL's mean is per row

    def teacher_rows(self, index: ChunkIndex, width: int) -> Tensor:
        """The teacher rows either merge reads: a chunk's token positions (observed) and the
        positions before them (bayesian): [first - 1, last] per complete chunk."""
        te = index.teacher
        chunks = complete_chunks(index)[0]
        first, n = te.first[chunks] - 1, te.count[chunks] + 1
        dev = first.device
        steps = torch.arange(int(n.sum()), device=dev) - torch.repeat_interleave(n.cumsum(0) - n, n)
        rows = torch.zeros(te.targets.numel(), dtype=torch.bool, device=dev)
        rows[torch.repeat_interleave(first, n) + steps] = True
        return rows.view(-1, te.width)

    def loss(self, logits_BSV, outs, index, *, tables, vocab_size, config, tp_group=None, cp=None):
        if tp_group is not None or cp is not None:
            raise ValueError(f"{NAME}: TRL's loss takes whole logits on whole rows (tp = cp = 1)")
        return trl_gold(logits_BSV, outs, index, uld=uld_for(config), vocab_size=vocab_size)


MODE = TrlGoldMode()


def register() -> None:
    """Put ``trl_gold`` in the registry (idempotent); importing this module does it."""
    MODES[NAME] = MODE


register()
