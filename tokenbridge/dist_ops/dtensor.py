"""DTensor entry point: vocab-sharded DTensor logits -> (local tensor, TP process group).

A column-parallel lm_head returns a DTensor sharded on the vocabulary; the vocab-parallel ops
take a plain local tensor plus a group. `to_local` has a backward, so gradients still reach the
model. Accepted: `Shard(-1)` on exactly one mesh dim, `Replicate()` on the others, even shards.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from tokenbridge.dist_ops.collectives import Group


def unwrap_vocab_sharded(logits: torch.Tensor | DTensor) -> tuple[torch.Tensor, Group]:
    """(local shard [..., V_local], group of the sharded mesh dim); plain tensors -> (x, None)."""
    if not isinstance(logits, DTensor):
        return logits, None
    ndim = logits.dim()
    sharded = []
    for mesh_dim, placement in enumerate(logits.placements):
        if isinstance(placement, Shard) and placement.dim in (-1, ndim - 1):
            sharded.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"logits DTensor placement {placement} on mesh dim {mesh_dim}: expected "
                "Shard(-1) on the TP dim and Replicate() elsewhere"
            )
    if len(sharded) != 1:
        raise ValueError(
            f"logits DTensor must be sharded on the vocab dim over exactly one mesh dim, "
            f"got placements {logits.placements}"
        )
    mesh_dim = sharded[0]
    if logits.shape[-1] % logits.device_mesh.size(mesh_dim):
        raise ValueError(
            f"vocab {logits.shape[-1]} is not divisible by the mesh dim size "
            f"{logits.device_mesh.size(mesh_dim)}: pad the lm_head"
        )
    return logits.to_local(), logits.device_mesh.get_group(mesh_dim)
