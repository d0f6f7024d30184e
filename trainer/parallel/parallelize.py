"""Process group start-up and the parallelism verbs applied to a plain HF causal LM.

Order (as in torchtitan): `apply_tp` with the model's plan, `apply_cp`, then `apply_fsdp`
(FSDP2 ``fully_shard`` per decoder layer, then the root). The model code knows nothing of this;
a per-model-type plan (a dict: module path inside a decoder layer -> style) does. The groups
and the (dp_shard, cp, tp) device mesh are `tokenbridge.dist_ops.ParallelGroups` (`build_mesh`);
the student and each teacher get their own, so a teacher may use another layout.

Tensor parallel: attention heads and MLP columns split over tp (the layer plan), and the
vocabulary too: the lm_head is column-parallel with its output left sharded (a DTensor,
``Shard(-1)``: [B, T, V / tp] per rank), the input embedding row-parallel (each rank holds the
same vocabulary rows as its lm_head shard; an id outside them reads zeros, summed over tp). Tied
embeddings (SmolLM2, Gemma) stay ONE parameter: both styles shard the [V, H] weight on dim 0,
so after sharding the lm_head points at the embedding's DTensor again and gets the gradient of
both uses. The full [B, T, V] logits never exist on one rank in training.

Context parallel: `apply_cp` routes attention through `trainer.parallel.cp_attention` (K and V all-gathered
over cp, a causal mask by global positions); the caller feeds each rank its positions in the
load-balanced layout with their global position ids (RoPE).

One code path for 1 and N processes: a plain ``python trainer/main.py`` becomes world size 1
with an in-memory store. gloo on CPU, NCCL on GPU.

Gradient scale: the step normalises every term itself (`tokenbridge.losses.base.normalize`),
so FSDP must sum gradients over the data- and context-parallel ranks instead of averaging them
(`apply_fsdp` sets the divide factor to 1).
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from trainer.parallel import cp_attention

# Styles per module path inside one decoder layer. "replicated_grad" marks parameters that stay
# whole on every TP rank but see only that rank's heads (Gemma's per-head q/k norms): their
# gradients are partial sums and `sync_replicated_grads` all-reduces them over TP.
_ATTN_MLP = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}
TP_PLANS: dict[str, dict[str, str]] = {
    "llama": _ATTN_MLP,
    "mistral": _ATTN_MLP,
    "qwen2": _ATTN_MLP,
    "gemma3_text": {
        **_ATTN_MLP,
        "self_attn.q_norm": "replicated_grad",
        "self_attn.k_norm": "replicated_grad",
    },
    "qwen3": {
        **_ATTN_MLP,
        "self_attn.q_norm": "replicated_grad",
        "self_attn.k_norm": "replicated_grad",
    },
}


def _style(name: str) -> ParallelStyle:
    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[name]()


def pick_device(name: str) -> torch.device:
    """ "auto" -> this rank's CUDA device when there is one, else CPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"device={name}: local rank {local_rank} has no GPU of its own "
            f"({torch.cuda.device_count()} visible); start at most that many processes per node, "
            "or use device=cpu"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device: torch.device, *, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join torchrun's process group (or make a world of one); returns (rank, world_size)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python trainer/main.py`: world size 1 of the same code path
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


def tp_plan(model_type: str) -> dict[str, str]:
    if model_type not in TP_PLANS:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r}; known: {sorted(TP_PLANS)}"
        )
    return TP_PLANS[model_type]


def check_tp(hf_config, tp: int, *, where: str) -> None:
    """Refuse a TP size that does not split the heads, the MLP or the vocabulary evenly (checked
    before loading weights: the vocab-parallel ops need equal shards)."""
    if tp == 1:
        return
    tp_plan(hf_config.model_type)
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    for name, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("intermediate_size", hf_config.intermediate_size),
        ("vocab_size (the lm_head width)", hf_config.vocab_size),
    ):
        if n % tp:
            raise ValueError(f"{where}: tp={tp} does not divide {name}={n}")


def check_cp(hf_config, cp: int, *, where: str) -> None:
    """Refuse CP for a model whose attention cannot be sequence-sharded by `trainer.parallel.cp_attention`
    (before loading weights): one without a plan here (its attention may not go through
    transformers' attention interface), or one with attention-logit softcapping (SDPA has none)."""
    if cp == 1:
        return
    if hf_config.model_type not in TP_PLANS:
        raise ValueError(
            f"{where}: cp={cp} needs attention through transformers' attention interface with "
            f"global position ids; model_type {hf_config.model_type!r} is not known to do that "
            f"(known: {sorted(TP_PLANS)})"
        )
    if getattr(hf_config, "attn_logit_softcapping", None):
        raise ValueError(
            f"{where}: cp={cp} runs attention with SDPA, which has no attention-logit "
            f"softcapping (attn_logit_softcapping={hf_config.attn_logit_softcapping})"
        )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a HF causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: expected decoder blocks at model.model.layers")
    return layers


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def shard_vocab(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The lm_head column-parallel with vocab-sharded DTensor logits, the input embedding
    row-parallel (vocabulary rows), one shared parameter when the two are tied (module doc)."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head to shard over the vocabulary")
    tied = head.weight is emb.weight
    styles = {
        _module_name(model, emb): RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        ),
        # left a DTensor: the loss reads its placement and unwraps the local shard
        _module_name(model, head): ColwiseParallel(
            output_layouts=Shard(-1), use_local_output=False
        ),
    }
    parallelize_module(model, tp_mesh, styles)
    if tied:
        # the lm_head was distributed from the old plain weight: point it at the embedding's
        # DTensor again (same [V, H] rows per rank: both styles shard dim 0)
        head.weight = emb.weight


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> list[str]:
    """Shard attention and MLP of every decoder layer over `tp_mesh`, and the vocabulary
    (`shard_vocab`); norms stay whole. Returns the names of the parameters whose gradients need
    `sync_replicated_grads` (names, because FSDP replaces the parameter objects later)."""
    if tp_mesh.size() == 1:
        return []
    styles = {k: _style(v) for k, v in plan.items() if v != "replicated_grad"}
    replicated = tuple(f".{path}." for path, v in plan.items() if v == "replicated_grad")
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, styles)
    shard_vocab(model, tp_mesh)
    return [n for n, _ in model.named_parameters() if any(r in n for r in replicated)]


def apply_cp(model: nn.Module, cp_size: int) -> None:
    """Attention through `trainer.parallel.cp_attention` (a no-op at cp = 1, so that path keeps SDPA
    untouched). The function falls back to plain SDPA for whole-sequence forwards (eval)."""
    if cp_size == 1:
        return
    check_cp(model.config, cp_size, where=type(model).__name__)
    cp_attention.register()
    model.set_attn_implementation(cp_attention.CP_ATTENTION)


@contextlib.contextmanager
def gathered_logits(model: nn.Module):
    """Within the block the lm_head returns whole logits (eval only: the scorer asks for a few
    positions' rows, bounded by its ``max_logits``; no gradient). Outside, and in training,
    they stay vocab-sharded."""
    head = model.get_output_embeddings()

    def full(module, inputs, out):
        return out.full_tensor() if isinstance(out, DTensor) else out

    handle = head.register_forward_hook(full) if head is not None else None
    try:
        yield model
    finally:
        if handle is not None:
            handle.remove()


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 over `fsdp_mesh` (dp, or dp x cp flattened): one unit per decoder layer, then the
    root (embeddings, final norm, lm_head). Gradients are summed, not averaged, over its ranks
    (see the module doc)."""
    for layer in decoder_layers(model):
        fully_shard(
            layer, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    # the root (embeddings, final norm, lm_head) stays unsharded from forward to backward, as
    # FSDP2 does by default: its parameters are needed again at once, and a chunked lm_head's
    # loss reads the weight in backward without a root pre-backward hook (`trainer.parallel.head`)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling
            m.set_force_sum_reduction_for_comms(True)
    return model


def sync_replicated_grads(
    model: nn.Module, names: list[str], tp_group: dist.ProcessGroup | None
) -> None:
    """Sum over TP the gradients of whole parameters that each TP rank used on its own heads."""
    if not names or tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    for p in (model.get_parameter(n) for n in names):
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=tp_group)


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (clipped to `max_norm` when > 0), for parameters that are
    plain tensors or DTensors on different meshes (TP-sharded layers next to FSDP-only ones):
    one norm per (mesh, placements) group, reduced by DTensor, then combined."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    if not groups:
        return torch.zeros(())
    norms = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append((n.full_tensor() if isinstance(n, DTensor) else n).float())
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if max_norm > 0:
        # a tensor factor, not `coef.item()`: reading it would wait for the device every step
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
