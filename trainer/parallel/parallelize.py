"""Process-group start-up and the parallelism verbs applied to a plain HF causal LM.

The verbs run in torchtitan's order, each on what the earlier ones left: `apply_tp` (the
model's plan), `apply_cp`, `apply_ac` (wraps the TP-sharded blocks), `apply_compile` (traces the
wrapped blocks), then `apply_fsdp` (shards the compiled ones). The model code knows nothing of
this; a per-model-type plan (`TP_PLANS`) does. The layouts: docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from trainer.config.sections import AC_MODES
from trainer.parallel import cp_attention, liveness

# what `checkpoint_wrapper` inserts into a wrapped block's parameter names (torch's own constant
# is private). ``state_dict`` and DCP's ``get_state_dict`` strip it (checkpoints and the export
# have the plain HF keys); ``named_parameters`` keeps it, so `plain_name` takes it out again
AC_PREFIX = "_checkpoint_wrapped_module."

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
        # a heartbeat in the rendezvous store: a failed collective can name a lost peer
        liveness.start(rank=dist.get_rank(), world=dist.get_world_size())
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
    """The lm_head column-parallel with vocab-sharded DTensor logits ([B, T, V / tp] per rank),
    the input embedding row-parallel (the same vocabulary rows; an id outside them reads zeros,
    summed over tp), one shared parameter when the two are tied (docs/parallelism.md, "Tensor
    parallel")."""
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


def apply_ac(model: nn.Module, mode: str, *, every: int = 2) -> list[int]:
    """Wrap decoder blocks in non-reentrant activation checkpointing, in place in their
    ModuleList (so `decoder_layers` and FSDP's per-layer units find the wrappers); returns the
    indices wrapped. A wrapped block's saved activations (attention, the MLP's 3 x
    intermediate-wide tensors) no longer live from forward to backward: about one block's worth
    at a time instead of one per layer, for one more forward of each wrapped block. ``full``:
    every block; ``every_n``: blocks i with i % `every` == 0 (a memory/compute trade between
    none and full); ``none``: nothing.

    Non-reentrant (`torch.utils.checkpoint` with ``use_reentrant=False``): it takes keyword
    arguments (the CP layout reaches attention as one) and inputs that need no gradient, and
    composes with FSDP2, whose hooks run on the wrapper, outside the recomputed region. The RNG
    state is saved so dropout, where a model has it, draws the same mask twice."""
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpointing: expected one of {list(AC_MODES)}, got {mode!r}"
        )
    if mode == "none":
        return []
    if every < 1:
        raise ValueError(f"activation checkpointing every_n: expected every >= 1, got {every}")
    layers = decoder_layers(model)
    chosen = [i for i in range(len(layers)) if mode == "full" or i % every == 0]
    for i in chosen:
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return chosen


def plain_name(name: str) -> str:
    """A parameter's name without the AC wrapper's prefix: its HF name, the key in
    ``state_dict``, checkpoints and the export."""
    return name.replace(AC_PREFIX, "")


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    """``torch.compile`` each decoder block in place (``Module.compile``: names unchanged, no
    ``_orig_mod.``), as torchtitan does: the embedding, the lm_head and the losses stay eager.
    With ``fullgraph=True``: a block that cannot be traced whole is an error at its first
    forward, not a silent fall-back to eager pieces. Shapes: torch's default, a
    first graph for the first length and one dynamic graph after a second length is seen (rows
    are padded to `data.pad_to_multiple`).

    The cost is paid by the first forward and backward, and again by the first new length
    (the dynamic graph). Inductor on this repository's CPU machines (AMD EPYC, 2 shared cores,
    gcc 12): a tiny 3-layer student, 15 s, then 24 s; SmolLM2-135M with AC (30 blocks, 256
    tokens, 1 thread), 18 s over the eager step, then 15 s; the blocks share their graphs, so
    it does not grow with the layers. No speed-up there at 256 tokens on CPU (3.5 s compiled vs
    3.0 s eager a step, the lm_head dominating): compile is for GPUs. Losses agree to ~1e-7
    relative. Inductor needs a C++ compiler on CPU (Triton on GPU)."""
    if getattr(model.config, "_attn_implementation", None) == cp_attention.CP_ATTENTION:
        # Under CP the one side effect in a block's forward is `cp_attention.CPAttention`'s mask
        # cache (filled by the first layer, read by the others), and dynamo refuses to trace a
        # side effect inside a checkpointed block that the recompute would not replay. Not
        # replaying it is exact: the recompute finds the cache filled. (Read when a block is
        # traced, at its first forward: a process-wide switch.)
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in decoder_layers(model):
        layer.compile(backend=backend, fullgraph=True)


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
    root (embeddings, final norm, lm_head). Gradients are summed, not averaged, over its ranks:
    the step normalises every term itself (`tokenbridge.losses.base.normalize`), so the divide
    factor is 1."""
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
    # by plain name: AC's wrapper put its prefix into the names `apply_tp` returned
    wanted = set(names)
    params = [p for n, p in model.named_parameters() if plain_name(n) in wanted]
    for p in params:
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
