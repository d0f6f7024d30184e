"""The trainer's configuration: the schema Hydra composes onto, and the one way to build it.

One dataclass per YAML section (`sections`, `loss_sections`), each checking its own values;
`TrainConfig` holds them and, once they are built, runs every rule that relates them
(`trainer.config.rules`). This module is the one to import them from. Everything here is pure,
so a bad config fails in milliseconds, before any file is read or model loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import MISSING, DictConfig, OmegaConf

from tokenbridge import paths
from trainer.config import rules
from trainer.config.checks import ConfigError, check_at_least, check_choice, fail
from trainer.config.keys import unknown_key, unknown_keys
from trainer.config.loss_sections import LossConfig, OnPolicyConfig
from trainer.config.sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TeacherConfig,
    check_location,
)

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OnPolicyConfig",
    "OptimConfig",
    "ParallelConfig",
    "TeacherConfig",
    "TrainConfig",
    "check_key",
    "from_dictconfig",
    "register_schema",
]

DEVICES = ("auto", "cpu", "cuda")


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
        """The top-level values and each teacher's, then every cross-section rule."""
        if not isinstance(self.model, ModelConfig):
            fail("model", "a model section (path, init, ...) is required")
        if not isinstance(self.data, DataConfig):
            fail("data", "a data section (shards, ...) is required")
        check_at_least("steps", self.steps, 1)
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            fail("stop_after", f"expected in [1, steps={self.steps}], got {self.stop_after}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            fail("time_budget_s", f"expected > 0 seconds, got {self.time_budget_s}")
        check_choice("device", self.device, DEVICES)
        if not self.run_dir:
            self.run_dir = str(Path("runs") / self.name)
        # metrics, reports and exports are local files: checkpoints alone go to a store
        try:
            check_location("run_dir", self.run_dir, schemes=())
        except ConfigError as e:
            raise ConfigError(
                f"{e}; for checkpoints in an object store set checkpoint.dir"
            ) from None
        for i, t in enumerate(self.teachers):
            t.check(i)
        rules.check_config(self)

    def teacher_modes(self) -> list[str]:
        """The loss mode of each teacher (its own, else loss.mode)."""
        return [t.loss or self.loss.mode for t in self.teachers]

    @property
    def kd_enabled(self) -> bool:
        return self.loss.mode != "ce" and self.loss.kd_weight > 0 and bool(self.teachers)


# paths in the YAML may use two resolvers: ${artifacts:models/x} under tokenbridge.paths's
# artifacts folder (TOKENBRIDGE_ARTIFACTS aware), ${repo:outputs/x} under the repository root
# (where `make projection` / `make align` write by default)
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
    "every key, with or without Hydra's + or ++, must be a field of the config dataclasses "
    "(trainer/config/sections.py, loss_sections.py; free keys only under loss.options and the "
    "models' overrides)"
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
