"""What names a model: a local HF directory, how it is initialised (the random-init recipe), and
the dtype its weights and compute use.

``"auto"`` is resolved by device in this one function (`resolve_dtype`: bfloat16 on CUDA,
float32 elsewhere) wherever the device is known (preflight, the teacher-cache job, the eval), so
no file or fingerprint records "auto". Kept apart from `tokenbridge.models` (torch,
transformers) so that a config check that needs only these rules runs in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

MODEL_INITS = ("pretrained", "random")
DTYPES = ("float32", "bfloat16", "float16")  # weights and compute, by name
AUTO = "auto"
DTYPE_CHOICES = (AUTO, *DTYPES)  # what a config or a flag may name


class ModelSource(Protocol):
    """What names a model: its HF directory, how it is initialised, and the random-init recipe.
    `ModelSpec` is the library's own; the trainer's config sections have the same fields."""

    path: str
    init: str
    overrides: dict[str, Any]
    seed: int


def check_model_source(src: ModelSource, where: str) -> None:
    """The rules every model source obeys (a ValueError naming `where` otherwise)."""
    if not src.path:
        raise ValueError(f"{where}.path: a model directory is required")
    if src.init not in MODEL_INITS:
        raise ValueError(f"{where}.init: expected one of {list(MODEL_INITS)}, got {src.init!r}")
    if src.overrides and src.init != "random":
        raise ValueError(f"{where}.overrides: config overrides only apply to init=random models")


@dataclass
class ModelSpec:
    """A causal LM from a local HF directory (config.json + tokenizer, + weights if pretrained).

    ``init="random"`` builds the directory's config.json with ``overrides`` applied, seeded with
    ``seed`` (tiny test models that keep the real tokenizer)."""

    path: str
    init: str = "pretrained"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    name: str = ""  # short name for logs; default: the directory name

    def __post_init__(self) -> None:
        check_model_source(self, "model")
        self.name = self.name or Path(self.path.rstrip("/")).name


def check_dtype(name: str, where: str, *, auto: bool = False) -> str:
    """`name` when it is a dtype `where` accepts (``auto`` too when `auto`), else ValueError."""
    choices = DTYPE_CHOICES if auto else DTYPES
    if name not in choices:
        raise ValueError(f"{where}: expected one of {list(choices)}, got {name!r}")
    return name


def resolve_dtype(name: str, device: object) -> str:
    """The dtype `name` means on `device` (a torch.device or its name: ``cuda``, ``cuda:1``,
    ``cpu``). ``auto``: bfloat16 on CUDA (tensor-core matmuls, half the memory of float32),
    float32 anywhere else (bfloat16 matmuls on CPUs are slow, and CPU runs are the small checks
    that compare numbers); any other name is itself, so a config naming float32 keeps it."""
    check_dtype(name, "dtype", auto=True)
    if name != AUTO:
        return name
    return "bfloat16" if str(device).split(":")[0] == "cuda" else "float32"
