"""Process group, device mesh, and the parallelism verbs applied to a plain HF model.

Order (as in torchtitan): `apply_tp` with the model's plan, then `apply_fsdp` (FSDP2
``fully_shard`` per decoder layer, then the root). The model code knows nothing of this; a
per-model-type plan (a dict: module path inside a decoder layer -> style) does. The student and
each teacher get their own mesh, so a teacher may use another TP size than the student.

One code path for 1 and N processes: a plain ``python trainer/main.py`` becomes world size 1
with an in-memory store. gloo on CPU, NCCL on GPU.

Gradient scale: the loop divides the local SUM loss by the GLOBAL count itself, so FSDP must sum
gradients over data-parallel ranks instead of averaging them (`apply_fsdp` sets the divide
factor to 1).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

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


@dataclass
class Mesh:
    """A (dp_shard, tp) device mesh and the groups the loop needs."""

    mesh: DeviceMesh
    dp_size: int
    tp_size: int

    @property
    def dp(self) -> DeviceMesh:
        return self.mesh["dp_shard"]

    @property
    def tp(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp.get_group()

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.tp.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.tp.get_local_rank()


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


def build_mesh(device: torch.device, *, dp: int, tp: int) -> Mesh:
    """A fresh (dp_shard, tp) mesh over all ranks; ranks of one TP group are adjacent."""
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    return Mesh(mesh, dp, tp)


def tp_plan(model_type: str) -> dict[str, str]:
    if model_type not in TP_PLANS:
        raise ValueError(
            f"no tensor-parallel plan for model_type {model_type!r}; known: {sorted(TP_PLANS)}"
        )
    return TP_PLANS[model_type]


def check_tp(hf_config, tp: int, *, where: str) -> None:
    """Refuse a TP size that does not split the heads evenly (checked before loading weights)."""
    if tp == 1:
        return
    tp_plan(hf_config.model_type)
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    for name, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("intermediate_size", inter),
    ):
        if n % tp:
            raise ValueError(f"{where}: tp={tp} does not divide {name}={n}")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a HF causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: expected decoder blocks at model.model.layers")
    return layers


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> list[str]:
    """Shard attention and MLP of every decoder layer over `tp_mesh` (embeddings, norms and the
    lm_head stay whole). Returns the names of the parameters whose gradients need
    `sync_replicated_grads` (names, because FSDP replaces the parameter objects later)."""
    if tp_mesh.size() == 1:
        return []
    styles = {k: _style(v) for k, v in plan.items() if v != "replicated_grad"}
    replicated = tuple(f".{path}." for path, v in plan.items() if v == "replicated_grad")
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, styles)
    return [n for n, _ in model.named_parameters() if any(r in n for r in replicated)]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2 over `dp_mesh`: one unit per decoder layer, then the root (embeddings, final norm,
    lm_head). Gradients are summed, not averaged, over the dp ranks (see the module doc)."""
    for layer in decoder_layers(model):
        fully_shard(
            layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
    )
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


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `t` over `group` in place (a no-op for a group of one) and return it."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t
