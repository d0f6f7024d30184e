"""The config sections that name loss modes: ``loss`` (off-policy) and ``onpolicy``.

Both look modes up in the loss-mode registry, never in a list of their own, and read a mode's
options through it field by field, so a bad option is refused by name (``config
loss.options.k: xtoken: expected >= 1``). The KD/CE combination is the library's
`CombineConfig`, built from the keys users write (`LossConfig.combine_config`). What needs more
than one section is in `trainer.config.rules`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.config.checks import (
    check_at_least,
    check_choice,
    check_positive,
    fail,
    library_field,
    registry,
)

if TYPE_CHECKING:
    from tokenbridge.losses.combine import CombineConfig

ONPOLICY_PROMPTS = ("text", "chat")
ONPOLICY_MIX = ("sum", "mixture")


@dataclass
class LossConfig:
    """Which distillation loss, and how it is combined with the student's own CE."""

    mode: str = (
        "ce"  # ce | kd_topk (same tokenizer) | xtoken | gold | alm (tokenbridge.losses.modes)
    )
    ce_weight: float = 1.0  # lambda_ce
    kd_weight: float = 1.0  # lambda_kd
    # fixed: lambda_kd * KD + lambda_ce * CE; dynamic: stopgrad(|CE|/|KD|) * KD + CE
    combine: str = "fixed"
    temperature: float = 1.0
    # the mode's own options (k, divergence, beta, ...): fields of its options dataclass
    # (KDTopKConfig, XTokenConfig, GoldConfig, AlmConfig), checked here by name, type and value
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_choice("loss.mode", self.mode, tuple(registry().MODES))
        self.combine_config()
        check_positive("loss.temperature", self.temperature)
        if self.mode == "ce" and self.ce_weight == 0:
            fail("loss.ce_weight", "mode=ce with ce_weight=0 trains nothing")

    def combine_config(self) -> CombineConfig:
        """The library's combination options from this section (ConfigError names the key)."""
        from tokenbridge.losses.combine import CombineConfig

        def build() -> CombineConfig:
            return CombineConfig(
                mode=self.combine, kd_weight=self.kd_weight, ce_weight=self.ce_weight
            )

        return library_field(build, prefix="loss", rename={"mode": "combine"})

    def mode_options(self, mode: str) -> Any:
        """The options dataclass of loss mode `mode` from ``options`` (``temperature`` fills a
        temperature field they leave unset); ConfigError names the bad field."""
        record = registry().MODES[mode]
        return library_field(
            lambda: record.parse_options(self.options, temperature=self.temperature),
            prefix="loss.options",
        )


@dataclass
class OnPolicyConfig:
    """On-policy distillation (`trainer.onpolicy`, docs/onpolicy.md): the student samples
    completions of prompts with its current weights, each teacher scores them in its worker."""

    enabled: bool = False
    # GKD's lambda: each step is on-policy with this probability (seeded, resumable), else an
    # off-policy batch from the shards with loss.mode (ce when no off-policy KD is wanted)
    lmbda: float = 1.0
    # the on-policy KD mode of every teacher: opd_topk (same tokenizer: the student's top-k +
    # tail), opd_pg (sampled reverse KL as a negative advantage, any tokenizer), or a chunk
    # mode for another tokenizer (xtoken, gold, alm) over the completion chunks
    loss: str = "opd_topk"
    teacher_losses: list[str] = field(default_factory=list)  # per teacher, overrides `loss`
    # each mode's options, by mode name: {opd_topk: {k: 16}, xtoken: {k: 32}} (the fields of
    # its options dataclass, as loss.options)
    options: dict[str, Any] = field(default_factory=dict)
    # sum: weighted sum of the teachers' terms; mixture: one target distribution mixed in
    # probability space from teachers that share the student's tokenizer
    mix: str = "sum"
    lag: int = 0  # 1: learn on rollouts sampled one update earlier (the teacher scores them while the student samples the next)
    prompts: str = "text"  # text: a prefix of a shard window; chat: conversation rows
    prompt_tokens: int = 32  # text prompts: student tokens of the window (BOS included)
    chat_data: str = ""  # chat prompts: a JSONL file of `messages` rows
    chat_template: str = ""  # the student's template ("" = its model's own)
    teacher_chat_templates: list[str] = field(default_factory=list)  # per teacher, "" = own
    prompts_per_step: int = 4  # per data-parallel rank
    n_samples: int = 1  # completions per prompt
    micro_batch_size: int = 0  # rollouts per forward/backward; 0 = a step's all at once
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    seed: int = 0
    eval_prompts: int = 8  # held-out prompts: the teacher's bits/byte of the student's text
    # model: sample with the student's own weights (exact on-policy); int8: an int8 copy made
    # at each rollout phase (CPU, Llama-family students: ~4x fewer bytes per decode step), each
    # position's loss weighted by the likelihood ratio of its state (trainer/onpolicy/importance.py)
    sampler_weights: str = "model"
    ratio_clip: float = 2.0  # int8 sampling: the cap on each position's ratio weight
    # int8 sampling: make a new copy every this many rollout phases (making one costs about
    # 15-20 decode steps on CPU; an older copy is another q, which the ratio corrects)
    sampler_refresh: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.lmbda <= 1.0:
            fail("onpolicy.lmbda", f"expected in [0, 1], got {self.lmbda}")
        check_choice("onpolicy.mix", self.mix, ONPOLICY_MIX)
        check_choice("onpolicy.prompts", self.prompts, ONPOLICY_PROMPTS)
        if self.lag not in (0, 1):
            fail("onpolicy.lag", f"expected 0 (exact on-policy) or 1, got {self.lag}")
        for name in ("prompt_tokens", "prompts_per_step", "n_samples", "max_new_tokens",
                     "sampler_refresh"):  # fmt: skip
            check_at_least(f"onpolicy.{name}", getattr(self, name), 1)
        for name in ("micro_batch_size", "eval_prompts"):
            check_at_least(f"onpolicy.{name}", getattr(self, name), 0)
        check_positive("onpolicy.temperature", self.temperature)
        check_choice("onpolicy.sampler_weights", self.sampler_weights, ("model", "int8"))
        if not self.ratio_clip >= 1.0:
            fail("onpolicy.ratio_clip", f"expected >= 1 (inf: no cap), got {self.ratio_clip}")
        if not 0.0 < self.top_p <= 1.0:
            fail("onpolicy.top_p", f"expected in (0, 1], got {self.top_p}")
        rollouts = self.prompts_per_step * self.n_samples
        if self.micro_batch_size and rollouts % self.micro_batch_size:
            fail(
                "onpolicy.micro_batch_size",
                f"{self.micro_batch_size} does not divide the {rollouts} rollouts of a step "
                "(prompts_per_step x n_samples)",
            )
        if self.enabled and self.prompts == "chat" and not self.chat_data:
            fail("onpolicy.chat_data", "chat prompts need a JSONL file of `messages` rows")

    def modes(self, n_teachers: int) -> list[str]:
        """The on-policy loss mode of each teacher."""
        given = list(self.teacher_losses)
        return [given[i] if i < len(given) and given[i] else self.loss for i in range(n_teachers)]

    def mode_options(self, mode: str, temperature: float) -> Any:
        """The options dataclass of on-policy mode `mode` (ConfigError names the bad field)."""
        record = registry().MODES[mode]
        given = self.options.get(mode) or {}
        if not isinstance(given, dict):
            fail(f"onpolicy.options.{mode}", f"expected a mapping of options, got {given!r}")
        return library_field(
            lambda: record.parse_options(given, temperature=temperature),
            prefix=f"onpolicy.options.{mode}",
        )
