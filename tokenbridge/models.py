"""Causal LMs from local HF directories: load (pretrained or tiny random-init), inspect, export.

The model code is plain transformers; nothing here knows about parallelism
(`trainer.parallel.parallelize` applies it to what this module builds). A ``random`` model keeps
its directory's config.json with small dimensions patched in (`ModelSpec.overrides`), so test
models run in milliseconds yet use that directory's real tokenizer. Weights move strictly both
ways: a key missing, unexpected or of another shape is refused by name, where transformers would
initialise it at random or drop it, with a warning.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from tokenbridge import atomic
from tokenbridge.model_init import record_build
from tokenbridge.model_spec import ModelSource, ModelSpec  # noqa: F401  (models.ModelSpec)
from tokenbridge.weight_slices import (  # noqa: F401  (models.WeightKeysError)
    SafetensorsWeights,
    ShardTarget,
    WeightKeysError,
    key_names,
)

# files of a HF directory that make up its tokenizer (copied into exports as they are)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def _names(keys, *, most: int = 8) -> str:
    return key_names(keys, most=most)


def load_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """``AutoModelForCausalLM.from_pretrained(path)``, refused when its weights do not match its
    config: a missing key (transformers would initialise it at random), an unexpected one (it
    would be dropped) or a shape mismatch, each named."""
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    wrong = [
        f"{what.replace('_', ' ')} {_names(map(str, keys))}" for what, keys in info.items() if keys
    ]
    if wrong:
        raise WeightKeysError(f"{path}: weights do not match config.json: {'; '.join(wrong)}")
    return model


def exact_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`state_dict` checked against `model`'s own keys, with tied aliases filled in.

    Keys `model` lacks, and keys it needs that `state_dict` lacks, are an error naming them. A
    weight tied to others (one tensor, several names) needs one of its names; given under
    several, the tensors must be equal (the export keeps one).
    """
    own = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for k, v in own.items():
        groups.setdefault(id(v), []).append(k)
    out, missing = dict(state_dict), []
    for names in groups.values():
        given = [k for k in names if k in state_dict]
        if not given:
            missing += names
            continue
        for k in given[1:]:
            if not torch.equal(state_dict[k], state_dict[given[0]]):
                raise WeightKeysError(
                    f"{k} and {given[0]} are tied in the model's config but differ in the state "
                    "dict (an export would keep only one of them)"
                )
        out.update({k: state_dict[given[0]] for k in names if k not in given})
    unexpected = set(state_dict) - set(own)
    if missing or unexpected:
        parts = [f"unexpected keys {_names(unexpected)}"] if unexpected else []
        parts += [f"missing keys {_names(missing)}"] if missing else []
        raise WeightKeysError(
            f"state dict does not match {type(model).__name__}: {'; '.join(parts)}"
        )
    return out


def model_config(cfg: ModelSource) -> PretrainedConfig:
    """The HF config of `cfg.path` with `cfg.overrides` applied (random-init models).

    Shrinking ``num_hidden_layers`` also shrinks a per-layer ``layer_types`` list (Gemma 3's
    sliding/full attention pattern), which transformers otherwise rejects as inconsistent.
    """
    path = Path(cfg.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a HF model directory)")
    overrides = dict(cfg.overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        base = AutoConfig.from_pretrained(path)
        layer_types = getattr(base, "layer_types", None)
        if layer_types:
            n = int(overrides["num_hidden_layers"])
            overrides["layer_types"] = [layer_types[i % len(layer_types)] for i in range(n)]
    try:
        return AutoConfig.from_pretrained(path, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: config overrides {overrides} rejected: {e}") from e


def build_model(
    cfg: ModelSource, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The causal LM of `cfg`: pretrained weights, or a seeded random init of its config.

    The random init draws from a forked RNG seeded with ``cfg.seed``, so every process that
    builds the same config on the same kind of device (student ranks, teacher workers) gets
    bit-identical weights, and the caller's RNG stream is untouched. On a GPU the weights are
    drawn there, by its RNG, not on the host then copied (billions of host draws: the GPU
    check's 1B/4B part ran past its two minutes once, where is not measured yet).
    """
    if cfg.init == "pretrained":
        path = Path(cfg.path)
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise FileNotFoundError(f"{path}: no weights (*.safetensors) for init=pretrained")
        model = load_pretrained(path, dtype=dtype)
    else:
        hf_cfg = model_config(cfg)
        dev = torch.device(device)
        gpu = dev.type == "cuda"
        forked = (
            [dev.index if dev.index is not None else torch.cuda.current_device()] if gpu else []
        )
        with torch.random.fork_rng(devices=forked), torch.device(dev if gpu else "cpu"):
            torch.manual_seed(cfg.seed)
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.to(device)


class MetaWeights:
    """The weights of a model built on the meta device (`build_meta`): `fill` copies each
    process's box of them (`ShardTarget`, by parameter name, any name of a tied one) from the
    recorded random init or the pretrained files."""

    def __init__(self, model: nn.Module, *, log=None, files: SafetensorsWeights | None = None):
        self.log, self.files = log, files
        self.alias: dict[str, str] = {}
        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        persistent = set(model.state_dict()) if files is not None else set()
        for name, b in model.named_buffers(remove_duplicate=False):
            if name in persistent:  # saved with the weights: read from the files too
                groups.setdefault(id(b), []).append(name)
        self.names = {names[0]: names for names in groups.values()}
        self.alias = {a: canon for canon, names in self.names.items() for a in names}
        params = dict(model.named_parameters(remove_duplicate=False))
        self.persistent_buffers = [n for n in self.names if n not in params]
        if files is not None:
            shapes = {
                canon: tuple(model.get_parameter_or_buffer(canon).shape) for canon in self.names
            }
            self.source = files.plan(
                self.names,
                shapes,
                ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None) or (),
                ignore_unexpected=getattr(model, "_keys_to_ignore_on_load_unexpected", None) or (),
            )

    def fill(self, targets: dict[str, ShardTarget]) -> None:
        """Every target filled; a name the model does not have is a KeyError."""
        canon = {}
        for name, t in targets.items():
            if name not in self.alias:
                raise KeyError(f"{name}: not a weight of this model")
            canon[self.alias[name]] = t
        if self.files is not None:
            self.files.fill(canon, self.source)
        else:
            self.log.replay(canon)


def build_meta(
    cfg: ModelSource, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, MetaWeights]:
    """The causal LM of `cfg` with its parameters on the meta device, and its weights.

    Nothing of the size of the model is allocated: the parallel plans are applied to the meta
    model, then each process materializes its shards (``to_empty``) and fills them from the
    returned `MetaWeights` (`trainer.parallel.materialize`). Buffers (rotary frequencies) are
    real, computed where `build_model` computes them, and kept. Pretrained weights are read by
    slices (`tokenbridge.weight_slices`), their keys checked here, before anything is read; a
    random init is recorded here and replayed per shard (`tokenbridge.model_init`): the same
    numbers as `build_model`, bit for bit.
    """
    dev = torch.device(device)
    if cfg.init == "pretrained":
        path = Path(cfg.path)
        if not any(path.glob("*.safetensors")):
            raise FileNotFoundError(f"{path}: no weights (*.safetensors) for a sharded load")
        hf_cfg = AutoConfig.from_pretrained(path)
        files = SafetensorsWeights(path)
        model, _ = record_build(
            lambda: AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype), seed=0, device="cpu"
        )
        model.eval()  # as from_pretrained returns it
        weights = MetaWeights(model, files=files)
    else:
        hf_cfg = model_config(cfg)
        gpu = dev.type == "cuda"  # drawn on the GPU, as build_model does
        with torch.device(dev if gpu else "cpu"):
            model, log = record_build(
                lambda: AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype),
                seed=cfg.seed,
                device=dev if gpu else torch.device("cpu"),
            )
        weights = MetaWeights(model, log=log)
    return model, weights


def vocab_width(model: nn.Module) -> int:
    """Columns of the model's logits: the lm_head width (>= the tokenizer's vocab_size: padded
    heads are wider). It is the student's vocabulary, never the tokenizer's size."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (not a causal LM?)")
    return int(head.weight.shape[0])


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def freeze(model: nn.Module) -> nn.Module:
    """Teacher mode: eval (no dropout), no gradients."""
    model.eval()
    model.requires_grad_(False)
    return model


def copy_tokenizer_files(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy the tokenizer files of HF dir `src_dir` into `out_dir`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / name)
            copied.append(name)
    if not any(n in copied for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"{src_dir}: no tokenizer files to export ({TOKENIZER_FILES})")
    return copied


def export_hf(
    state_dict: dict[str, torch.Tensor],
    *,
    cfg: ModelSource,
    out_dir: str | os.PathLike,
    extra: dict | None = None,
) -> Path:
    """Write a full (unsharded) student state dict as a plain HF directory, atomically.

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` and any tokenizer loader read the result;
    ``extra`` goes to ``tokenbridge.json`` next to it (provenance: step, run, teachers). Strict:
    a key of `state_dict` the config's model lacks, or one it needs that is absent, is a
    `WeightKeysError` naming it (`exact_state_dict`), and nothing is written.
    """
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    with atomic.replacing(out, tmp=tmp, directory=True):
        hf_cfg = model_config(cfg)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_cfg)
        try:
            model.load_state_dict(exact_state_dict(model, state_dict), strict=True, assign=True)
        except WeightKeysError as e:
            raise WeightKeysError(f"export of {cfg.path} to {out}: {e}") from None
        model.tie_weights()
        left = [k for k, p in model.state_dict().items() if p.is_meta]
        if left:  # strict loading above makes this impossible; a cheap guard all the same
            raise WeightKeysError(f"export: state dict lacks {_names(left)}")
        model.save_pretrained(tmp)
        copy_tokenizer_files(cfg.path, tmp)
        if extra:
            (tmp / "tokenbridge.json").write_text(json.dumps(extra, indent=2, sort_keys=True))
    return out
