"""The trainer's configuration: one structured dataclass per section, validated on construction.

Hydra composes ``conf/train.yaml`` and its groups (model/, teachers/, loss/, data/, parallel/,
experiment/); every key of the result must be a field here (`trainer.config.keys`: Hydra's ``+``
adds no key), then it is merged onto `TrainConfig` (wrong types fail at once) and turned into
these dataclasses, whose ``__post_init__`` checks every value and says
which field is wrong and what it expected. Everything here is pure: nothing touches the file
system or loads a model, so a bad config fails in milliseconds (file and fingerprint checks
follow in `trainer.config.preflight`, still before any model loads). Loss modes and their options are
checked against the loss-mode registry (`tokenbridge.losses.modes.MODES`), field by field; the first
such check imports the registry, and torch with it (about 2 s on these machines).

Paths may use two resolvers: ``${artifacts:models/x}`` points under `tokenbridge.paths`'s
artifacts folder (``TOKENBRIDGE_ARTIFACTS`` aware), ``${repo:outputs/x}`` under the repository
root (where `make projection` / `make align` write by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from tokenbridge import paths
from tokenbridge.formats.checksums import VERIFY_MODES
from tokenbridge.model_spec import DTYPES, check_model_source
from trainer.config.keys import unknown_key, unknown_keys


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _fail(where: str, msg: str) -> None:
    raise ConfigError(f"config {where}: {msg}")


def _check_choice(where: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(where, f"expected one of {list(choices)}, got {value!r}")


def _check_positive(where: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        _fail(
            where, f"expected a {'non-negative' if allow_zero else 'positive'} number, got {value}"
        )


def _registry() -> ModuleType:
    """`tokenbridge.losses.modes` (MODES, KD_MODES, OptionError). Imported on first use, not with
    this module: it brings torch (~2 s), and a config that Hydra already refuses (an unknown
    key, a wrong type) should fail before that."""
    import tokenbridge.losses.modes

    return tokenbridge.losses.modes


COMBINE_MODES = ("fixed", "dynamic")
TEACHER_PLACEMENTS = ("worker", "inprocess")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    """A causal LM from a local HF directory (config.json + tokenizer, + weights if pretrained)."""

    path: str = MISSING
    # "pretrained": load the weights; "random": build from the dir's config.json with
    # `overrides` applied (tiny test models that keep the real tokenizer) and seed `seed`.
    init: str = "pretrained"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    name: str = ""  # short name for logs; default: the directory name

    def __post_init__(self) -> None:
        self._validate("model")

    def _validate(self, where: str) -> None:
        if self.path == MISSING:
            _fail(f"{where}.path", "a model directory is required")
        try:
            check_model_source(self, where)
        except ValueError as e:
            raise ConfigError(f"config {e}") from None
        if not self.name:
            self.name = Path(self.path).name


@dataclass
class TeacherConfig(ModelConfig):
    """One teacher: its model, the projection to the student vocab, its weight and TP size."""

    # sparse vocabulary projection (tokenbridge.projection .safetensors); required by the
    # cross-tokenizer losses (xtoken, gold), unused when teacher and student share a tokenizer
    projection: str | None = None
    weight: float = 1.0
    tp: int = 1
    loss: str | None = None  # per-teacher loss mode; default: loss.mode
    dtype: str = "float32"  # the frozen teacher's weights and compute (no master copy needed)
    # an offline teacher cache (`make teacher-cache`): read its outputs instead of running the
    # teacher (no worker, no weights loaded); refused unless built from these shards with this
    # teacher, k and temperature (docs/training.md, "Teacher cache")
    cache: str | None = None

    def __post_init__(self) -> None:
        self._validate("teachers[?]")

    def check(self, i: int) -> None:
        where = f"teachers[{i}]"
        self._validate(where)
        _check_positive(f"{where}.weight", self.weight, allow_zero=True)
        if self.tp < 1:
            _fail(f"{where}.tp", f"expected >= 1, got {self.tp}")
        if self.loss is not None:
            _check_choice(f"{where}.loss", self.loss, _registry().KD_MODES)
        _check_choice(f"{where}.dtype", self.dtype, DTYPES)


@dataclass
class DataConfig:
    """Aligned shards (made by `make align`) and how they are cut into microbatches."""

    shards: str = MISSING
    micro_batch_size: int = 2  # rows per microbatch per data-parallel rank
    grad_accum: int = 1  # microbatches per optimizer step per rank
    max_student_tokens: int = 512  # a longer row is an error (re-align with shorter windows)
    pad_to_multiple: int = 8  # pad each microbatch's length up to a multiple of this
    shuffle_buffer: int = 256  # rows held for the bounded shuffle (0 = file order)
    seed: int = 0
    eval_fraction: float = 0.05  # share held out (by hash) for eval BPB
    # what is held out: window = (doc id, window) pairs; document = whole documents by doc id
    # (no window of a held-out document is trained on: the in-domain score of docs/science.md)
    eval_split: str = "window"
    # checksums of the shard files against their COMPLETED marker (docs/integrity.md):
    # first_open (each file when first mapped) | preflight (all before any model) | never
    verify: str = "first_open"

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            _fail("data.verify", f"expected one of {list(VERIFY_MODES)}, got {self.verify!r}")
        if not self.shards or self.shards == MISSING:
            _fail("data.shards", "a shard directory (from `make align`) is required")
        for name in ("micro_batch_size", "grad_accum", "max_student_tokens", "pad_to_multiple"):
            if getattr(self, name) < 1:
                _fail(f"data.{name}", f"expected >= 1, got {getattr(self, name)}")
        if self.shuffle_buffer < 0:
            _fail("data.shuffle_buffer", f"expected >= 0, got {self.shuffle_buffer}")
        if self.eval_split not in ("window", "document"):
            _fail("data.eval_split", f"expected window or document, got {self.eval_split!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            _fail("data.eval_fraction", f"expected in [0, 1), got {self.eval_fraction}")


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
        _check_choice("loss.mode", self.mode, tuple(_registry().MODES))
        _check_choice("loss.combine", self.combine, COMBINE_MODES)
        _check_positive("loss.ce_weight", self.ce_weight, allow_zero=True)
        _check_positive("loss.kd_weight", self.kd_weight, allow_zero=True)
        _check_positive("loss.temperature", self.temperature)
        if self.mode == "ce" and self.ce_weight == 0:
            _fail("loss.ce_weight", "mode=ce with ce_weight=0 trains nothing")

    def mode_options(self, mode: str) -> Any:
        """The options dataclass of loss mode `mode` from ``options`` (``temperature`` fills a
        temperature field they leave unset); ConfigError names the bad field."""
        registry = _registry()
        try:
            return registry.MODES[mode].parse_options(self.options, temperature=self.temperature)
        except registry.OptionError as e:
            _fail(f"loss.options.{e.field}", e.reason)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr; global-norm clipping."""

    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 = no clipping (the norm is still logged)
    # a non-finite loss term or gradient norm: false = stop the run, naming the step, the term
    # and the last good checkpoint; true = skip that step (no update, gradients zeroed) and go
    # on. Stopping is the default: a NaN mostly means a bug or a diverged run, and silently
    # skipping steps would hide it (docs/training.md)
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        _check_positive("optim.lr", self.lr)
        _check_positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _check_positive("optim.eps", self.eps)
        _check_positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail("optim.betas", f"expected two numbers in [0, 1), got {list(self.betas)}")
        if self.warmup_steps < 0:
            _fail("optim.warmup_steps", f"expected >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("optim.min_lr_ratio", f"expected in [0, 1], got {self.min_lr_ratio}")


@dataclass
class ParallelConfig:
    """The device mesh (dp_shard x cp x tp) of the student, mixed precision, teacher placement."""

    dp_shard: int = -1  # -1: world_size / (cp * tp)
    tp: int = 1  # tensor parallel: heads, MLP and the vocabulary (lm_head, embeddings) split
    cp: int = 1  # context parallel: each sequence split over cp ranks (load-balanced layout)
    param_dtype: str = "float32"  # FSDP2 MixedPrecisionPolicy
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    # "worker": each rank's teacher runs in its own process and hands its outputs over the
    # shared-memory (CPU) / CUDA IPC (GPU) channel; "inprocess": same process (debugging)
    teacher_placement: str = "worker"
    channel_slots: int = 2  # ring slots per channel; 2 lets the teacher run one microbatch ahead
    teacher_timeout_s: float = 300.0  # a teacher worker silent this long is declared hung
    threads: int = 0  # torch intra-op threads per process; 0 = leave torch's default

    def __post_init__(self) -> None:
        if self.dp_shard == 0 or self.dp_shard < -1:
            _fail("parallel.dp_shard", f"expected -1 (auto) or >= 1, got {self.dp_shard}")
        if self.tp < 1:
            _fail("parallel.tp", f"expected >= 1, got {self.tp}")
        if self.cp < 1:
            _fail("parallel.cp", f"expected >= 1, got {self.cp}")
        _check_choice("parallel.param_dtype", self.param_dtype, DTYPES)
        _check_choice("parallel.reduce_dtype", self.reduce_dtype, DTYPES)
        _check_choice("parallel.teacher_placement", self.teacher_placement, TEACHER_PLACEMENTS)
        if self.channel_slots < 1:
            _fail("parallel.channel_slots", f"expected >= 1, got {self.channel_slots}")
        _check_positive("parallel.teacher_timeout_s", self.teacher_timeout_s)
        if self.threads < 0:
            _fail("parallel.threads", f"expected >= 0, got {self.threads}")

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp_shard, cp, tp) for `world_size` processes, or ConfigError when they do not
        multiply."""
        dp = world_size // (self.cp * self.tp) if self.dp_shard == -1 else self.dp_shard
        if dp < 1 or dp * self.cp * self.tp != world_size:
            _fail(
                "parallel",
                f"dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} must equal the world "
                f"size {world_size} (torchrun --nproc_per_node)",
            )
        return dp, self.cp, self.tp


@dataclass
class CheckpointConfig:
    """DCP checkpoints (model, optimizer, scheduler, data position, RNG) and the HF export."""

    interval: int = 0  # save every N steps (0 = only at the end)
    keep: int = 2  # keep the newest N checkpoints
    resume: str = "auto"  # auto (newest in the run dir, if any) | none | <checkpoint path>
    # resume=auto and the newest checkpoint fails its checksums: false = move it aside and
    # resume from the newest that verifies; true = refuse (docs/integrity.md)
    strict: bool = False
    save_at_end: bool = True
    export_at_end: bool = True  # student as a plain HF dir (safetensors + tokenizer)

    def __post_init__(self) -> None:
        if self.interval < 0:
            _fail("checkpoint.interval", f"expected >= 0, got {self.interval}")
        if self.keep < 1:
            _fail("checkpoint.keep", f"expected >= 1, got {self.keep}")
        if not self.resume:
            _fail("checkpoint.resume", "expected auto, none or a checkpoint path")


@dataclass
class EvalConfig:
    """Held-out bits per byte of the student (before, every N steps, after) and of the teacher."""

    interval: int = 0  # every N steps (0 = only before and after training)
    max_texts: int = 32  # held-out windows evaluated (the first ones, a fixed set)
    batch_size: int = 4
    teacher: bool = True  # the teachers' BPB once, for reference

    def __post_init__(self) -> None:
        if self.interval < 0:
            _fail("eval.interval", f"expected >= 0, got {self.interval}")
        if self.max_texts < 0:
            _fail("eval.max_texts", f"expected >= 0, got {self.max_texts}")
        if self.batch_size < 1:
            _fail("eval.batch_size", f"expected >= 1, got {self.batch_size}")


@dataclass
class LoggingConfig:
    """Per-step metrics: JSONL and TensorBoard under the run dir, tqdm progress on rank 0."""

    interval: int = 1  # write metrics every N steps
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.interval < 1:
            _fail("logging.interval", f"expected >= 1, got {self.interval}")


ONPOLICY_PROMPTS = ("text", "chat")
ONPOLICY_MIX = ("sum", "mixture")


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
    lag: int = 0  # 1: the teacher scores step i+1's rollouts while the student learns on step i
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

    def __post_init__(self) -> None:
        if not 0.0 <= self.lmbda <= 1.0:
            _fail("onpolicy.lmbda", f"expected in [0, 1], got {self.lmbda}")
        _check_choice("onpolicy.mix", self.mix, ONPOLICY_MIX)
        _check_choice("onpolicy.prompts", self.prompts, ONPOLICY_PROMPTS)
        if self.lag not in (0, 1):
            _fail("onpolicy.lag", f"expected 0 (exact on-policy) or 1, got {self.lag}")
        for name in ("prompt_tokens", "prompts_per_step", "n_samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                _fail(f"onpolicy.{name}", f"expected >= 1, got {getattr(self, name)}")
        for name in ("micro_batch_size", "eval_prompts"):
            if getattr(self, name) < 0:
                _fail(f"onpolicy.{name}", f"expected >= 0, got {getattr(self, name)}")
        _check_positive("onpolicy.temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            _fail("onpolicy.top_p", f"expected in (0, 1], got {self.top_p}")
        rollouts = self.prompts_per_step * self.n_samples
        if self.micro_batch_size and rollouts % self.micro_batch_size:
            _fail(
                "onpolicy.micro_batch_size",
                f"{self.micro_batch_size} does not divide the {rollouts} rollouts of a step "
                "(prompts_per_step x n_samples)",
            )
        if self.enabled and self.prompts == "chat" and not self.chat_data:
            _fail("onpolicy.chat_data", "chat prompts need a JSONL file of `messages` rows")

    def modes(self, n_teachers: int) -> list[str]:
        """The on-policy loss mode of each teacher."""
        given = list(self.teacher_losses)
        return [given[i] if i < len(given) and given[i] else self.loss for i in range(n_teachers)]

    def mode_options(self, mode: str, temperature: float) -> Any:
        """The options dataclass of on-policy mode `mode` (ConfigError names the bad field)."""
        registry = _registry()
        given = self.options.get(mode) or {}
        if not isinstance(given, dict):
            _fail(f"onpolicy.options.{mode}", f"expected a mapping of options, got {given!r}")
        try:
            return registry.MODES[mode].parse_options(given, temperature=temperature)
        except registry.OptionError as e:
            _fail(f"onpolicy.options.{mode}.{e.field}", e.reason)

    def check(self, teachers: list[TeacherConfig], temperature: float) -> None:
        """What needs the teachers and the registry (run by TrainConfig when enabled)."""
        registry = _registry()
        if not teachers:
            _fail("onpolicy.enabled", "on-policy distillation needs at least one teacher")
        if len(self.teacher_losses) > len(teachers):
            _fail("onpolicy.teacher_losses", f"{len(teachers)} teachers, more modes given")
        modes = self.modes(len(teachers))
        for key in self.options:
            if key not in modes:
                _fail(f"onpolicy.options.{key}", f"options of a mode no teacher uses ({modes})")
        for i, mode in enumerate(modes):
            _check_choice(f"onpolicy.teacher_losses[{i}]", mode, registry.KD_MODES)
            self.mode_options(mode, temperature)
            if teachers[i].tp != 1:
                _fail(f"teachers[{i}].tp", "on-policy scoring runs tp=1 teachers so far")
        if self.mix == "mixture" and (len(set(modes)) != 1 or modes[0] not in MIXABLE):
            _fail(
                "onpolicy.mix",
                f"mixture needs one mode of {list(MIXABLE)} for every teacher, got {modes}",
            )


MIXABLE = ("opd_topk", "opd_pg")


@dataclass
class TrainConfig:
    """The whole run. `steps` sets the LR schedule; `stop_after` ends a run early (as if it
    were interrupted) without changing the schedule, so a resumed run continues it exactly.
    `time_budget_s` ends training once this process has spent that long in steps (a
    same-wall-clock comparison, e.g. on-policy vs off-policy KD vs CE); the run then finishes
    as at `steps` (after-evals, checkpoint, export)."""

    name: str = "run"
    run_dir: str = ""  # default: runs/<name>
    seed: int = 0
    steps: int = 100
    stop_after: int | None = None
    time_budget_s: float | None = None
    device: str = "auto"  # auto: cuda when available, else cpu (gloo)
    model: ModelConfig = MISSING
    teachers: list[TeacherConfig] = field(default_factory=list)
    data: DataConfig = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    onpolicy: OnPolicyConfig = field(default_factory=OnPolicyConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            _fail("model", "a model section (path, init, ...) is required")
        if not isinstance(self.data, DataConfig):
            _fail("data", "a data section (shards, ...) is required")
        if self.steps < 1:
            _fail("steps", f"expected >= 1, got {self.steps}")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            _fail("stop_after", f"expected in [1, steps={self.steps}], got {self.stop_after}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            _fail("time_budget_s", f"expected > 0 seconds, got {self.time_budget_s}")
        _check_choice("device", self.device, DEVICES)
        if not self.run_dir:
            self.run_dir = str(Path("runs") / self.name)
        for i, t in enumerate(self.teachers):
            t.check(i)
        if self.loss.mode != "ce" and not self.teachers:
            _fail("teachers", f"loss.mode={self.loss.mode} needs at least one teacher")
        if self.loss.mode != "ce":
            # the options of every mode that will read them (a teacher's own, else loss.mode)
            for mode in dict.fromkeys(self.teacher_modes()):
                self.loss.mode_options(mode)
        cp = self.parallel.cp
        if cp > 1 and self.data.pad_to_multiple % (2 * cp):
            # the load-balanced layout cuts every row into 2 * cp equal pieces
            _fail(
                "data.pad_to_multiple",
                f"parallel.cp={cp} cuts each sequence into 2 * cp = {2 * cp} equal pieces, so "
                f"the padded length must divide by {2 * cp}; pad_to_multiple="
                f"{self.data.pad_to_multiple} does not (use a multiple of {2 * cp})",
            )
        for i, mode in enumerate(self.teacher_modes()):
            if self.loss.mode != "ce" and _registry().MODES[mode].onpolicy_only:
                where = f"teachers[{i}].loss" if self.teachers[i].loss else "loss.mode"
                _fail(where, f"{mode} reads the student's own samples: use it as onpolicy.loss")
        if self.onpolicy.enabled:
            self.onpolicy.check(self.teachers, self.loss.temperature)
            if self.parallel.cp > 1:
                # the sampler decodes with a KV cache and the on-policy losses read whole rows
                _fail("parallel.cp", "on-policy steps run at cp=1 so far (tp and dp work)")
        if self.optim.warmup_steps > self.steps:
            _fail("optim.warmup_steps", f"{self.optim.warmup_steps} > steps={self.steps}")

    def teacher_modes(self) -> list[str]:
        """The loss mode of each teacher (its own, else loss.mode)."""
        return [t.loss or self.loss.mode for t in self.teachers]

    @property
    def kd_enabled(self) -> bool:
        return self.loss.mode != "ce" and self.loss.kd_weight > 0 and bool(self.teachers)


def _artifacts_resolver(sub: str = "") -> str:
    return str(paths.artifacts_dir() / sub)


def _repo_resolver(sub: str = "") -> str:
    return str(paths.REPO_ROOT / sub)


if not OmegaConf.has_resolver("artifacts"):
    OmegaConf.register_new_resolver("artifacts", _artifacts_resolver)
if not OmegaConf.has_resolver("repo"):
    OmegaConf.register_new_resolver("repo", _repo_resolver)


SCHEMA_NAME = "tokenbridge_schema"


def register_schema() -> None:
    """Give Hydra the dataclasses as the base of conf/train.yaml (``defaults: [tokenbridge_schema,
    ...]``), so every field can be overridden from the command line and is type-checked while
    composing, even where no YAML file mentions it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


_FREE_KEYS = (
    "every key, with or without Hydra's + or ++, must be a field of trainer/config/schema.py "
    "(free keys only under loss.options and the models' overrides)"
)


def check_key(path: str) -> None:
    """ConfigError unless the dotted `path` (``teachers.0.weight``) is a key of the schema."""
    msg = unknown_key(path.split("."), TrainConfig)
    if msg is not None:
        raise ConfigError(f"config {msg}; {_FREE_KEYS}")


def from_dictconfig(cfg: DictConfig | dict) -> TrainConfig:
    """Hydra's composed config -> a validated `TrainConfig` (ConfigError names the bad field)."""
    # unknown keys first: OmegaConf's merge would keep a key Hydra added with `+` and
    # `to_object` would then drop it without a word
    plain = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    unknown = unknown_keys(plain, TrainConfig)
    if unknown:
        raise ConfigError(f"config {'; '.join(unknown)}; {_FREE_KEYS}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg)
        obj = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's own errors: unknown key, wrong type, missing value
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(f"config: {e}".strip()) from None
    assert isinstance(obj, TrainConfig)
    return obj
