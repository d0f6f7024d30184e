"""The one model of a rank's process groups: `ParallelGroups`, built from a device mesh or by hand.

The trainer's come from one (dp_replicate, dp_shard, cp, tp) `DeviceMesh`, TP fastest
(`build_mesh`), which also gives the sub-meshes the torch APIs want; tests build them by hand
(`trainer.parallel.spawn.build_parallel_groups`). A group of `None` is a dimension of size 1, so
one process takes the very same path. What each dimension means for the objective, and which
groups sum: docs/parallelism.md, "The mesh".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tokenbridge.dist_ops.collectives import (
    Group,
    all_reduce_,
    global_count,
    group_rank,
    group_size,
)

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups (and, in the trainer, the device mesh) of one rank.

    `tp`: ranks holding the same tokens and a slice of the weights and of the vocabulary (the
    objective is replicated on them: nothing is summed over tp). `cp`: ranks holding other
    positions of the same sequences. `dp`: ranks holding other sequences.

    `mesh`: the (dp_replicate, dp_shard, cp, tp) `DeviceMesh` when built by `build_mesh`.
    `fsdp_mesh`: the mesh FSDP shards over (dp_shard, flattened with cp when cp > 1), 2-D
    (dp_replicate, that) when the shards are replicated (HSDP).
    `dp`: every data-parallel rank (dp_replicate x dp_shard).
    `dp_cp`: one group over dp x cp, the ranks holding other tokens than this one, over which
    counts, losses and gradients are summed (the loss invariant of
    `tokenbridge.losses.base.normalize`); None: reduce over `dp` then `cp`, or size 1.
    `batch`: the ranks holding the same microbatch, cp x tp of one dp group (None: size 1); their
    teachers split its rows (`trainer.teacher.dispatch.SharedBatchTeacher`).
    """

    tp: Group = None
    cp: Group = None
    dp: Group = None
    dp_cp: Group = None
    batch: Group = None
    mesh: DeviceMesh | None = None
    fsdp_mesh: DeviceMesh | None = None

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.tp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)

    @property
    def tp_mesh(self) -> DeviceMesh:
        if self.mesh is None:
            raise ValueError("these ParallelGroups were built without a device mesh")
        return self.mesh["tp"]

    def sum_over_tokens_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce (SUM, in place, outside autograd) over the ranks holding other tokens:
        dp and cp, never tp. Counts, loss shares and metric sums of a step go through here."""
        if self.dp_cp is not None:
            return all_reduce_(t, self.dp_cp)
        return all_reduce_(all_reduce_(t, self.dp), self.cp)

    def global_count(self, count: torch.Tensor | int | float) -> torch.Tensor:
        """`global_count(count, dp_group=self.dp, cp_group=self.cp)`."""
        return global_count(count, dp_group=self.dp, cp_group=self.cp)


SINGLE = ParallelGroups()
"""World size 1 in every dimension: the single-process path."""


def _group(mesh: DeviceMesh) -> Group:
    # a dimension of size 1 is `None`: the losses then take their single-device path
    return mesh.get_group() if mesh.size() > 1 else None


def build_mesh(
    device: torch.device, *, dp: int, cp: int = 1, tp: int = 1, replicate: int = 1
) -> ParallelGroups:
    """A fresh (dp_replicate, dp_shard, cp, tp) mesh over all ranks, and this rank's groups.

    Collective: every rank calls it with the same sizes. With cp > 1 FSDP shards over dp x cp
    (a flattened sub-mesh): the cp ranks of a dp group hold the same weights and must sum their
    gradients, which the reduce-scatter over the flattened mesh does. With `replicate` > 1 FSDP
    gets the 2-D (dp_replicate, shard) mesh (HSDP), and `dp` / `dp_cp` span the replicas too:
    the loss and its counts are summed over every data-parallel rank, as FSDP sums the
    gradients (reduce-scatter over the shard dim, all-reduce over the replicas). `batch` is
    the cp x tp sub-mesh, flattened when both are > 1.
    """
    mesh = init_device_mesh(device.type, (replicate, dp, cp, tp), mesh_dim_names=MESH_DIMS)
    shard = "dp_shard"
    if cp > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    if replicate > 1:
        fsdp_mesh = mesh["dp_replicate", shard]
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        dp_cp_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp") if cp > 1 else dp_mesh
    else:
        fsdp_mesh = dp_cp_mesh = mesh[shard]
        dp_mesh = mesh["dp_shard"]
    if cp > 1 and tp > 1:
        batch_mesh = mesh["cp", "tp"]._flatten("cp_tp")
    else:
        batch_mesh = mesh["cp"] if cp > 1 else mesh["tp"]
    return ParallelGroups(
        tp=_group(mesh["tp"]),
        cp=_group(mesh["cp"]),
        dp=_group(dp_mesh),
        dp_cp=_group(dp_cp_mesh),
        batch=_group(batch_mesh),
        mesh=mesh,
        fsdp_mesh=fsdp_mesh,
    )
