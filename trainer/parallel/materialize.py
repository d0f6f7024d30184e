"""A model built on the meta device and parallelized there, made real one shard per rank.

`materialize` allocates each rank's local tensors only (``to_empty``) and fills exactly the box
of the global weights each one holds (`local_box`, read from a DTensor's placements), from the
recorded random init or safetensors read by slices: host memory per rank stays near the model's
size over the number of ranks that shard it (docs/parallelism.md, "Built on the meta device,
loaded by shards").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from tokenbridge.models import MetaWeights
from tokenbridge.weight_slices import ShardTarget, whole
from trainer.parallel.parallelize import plain_name


def _chunk(idx: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """Chunk `c` of `n` of an index list, as ``torch.chunk`` splits it (empty past its end)."""
    chunks = torch.chunk(idx, n)
    return chunks[c] if c < len(chunks) else idx[:0]


def local_box(p: torch.Tensor) -> tuple[slice, ...]:
    """The rows, columns, ... of the global weight that this rank's local tensor of `p` holds.

    Placements are walked left to right over the mesh, each ``Shard(d)`` taking this rank's
    chunk of the indices of dim d held so far; FSDP2 over a TP-sharded dim is a
    ``_StridedShard`` (sharded as if after the TP dims to its right): the held indices are cut
    in `split_factor` pieces and this rank takes its chunk of each. A box that is not
    contiguous is refused (no layout of ours makes one); its size is checked against the
    local tensor."""
    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    mesh, coord = p.device_mesh, p.device_mesh.get_coordinate()
    held = [torch.arange(n) for n in p.shape]
    for i, placement in enumerate(p.placements):
        strided = isinstance(placement, _StridedShard)  # not a Shard to `is_shard`
        if not (strided or placement.is_shard()):
            continue
        d, n, c = placement.dim % p.dim(), mesh.size(i), coord[i]
        if strided:
            pieces = torch.chunk(held[d], placement.split_factor)
            held[d] = torch.cat([_chunk(piece, n, c) for piece in pieces])
        else:
            held[d] = _chunk(held[d], n, c)
    box = []
    for d, idx in enumerate(held):
        start = int(idx[0]) if len(idx) else 0
        if len(idx) and not torch.equal(idx, torch.arange(start, start + len(idx))):
            raise ValueError(f"placements {p.placements}: rank holds rows of dim {d} apart")
        box.append(slice(start, start + len(idx)))
    return tuple(box)


def shard_target(p: torch.Tensor) -> ShardTarget:
    """What this rank must fill of parameter `p` (a DTensor, or a plain tensor held whole)."""
    if not isinstance(p, DTensor):
        return whole(p.data)
    return ShardTarget(p.to_local(), local_box(p), tuple(p.shape))


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, owner, owner's name) for each parameter also held by an earlier module."""
    first: dict[int, tuple[nn.Module, str]] = {}
    out = []
    for _, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None:
                continue
            owner = first.setdefault(id(p), (module, name))
            if owner != (module, name):
                out.append((module, name, *owner))
    return out


@torch.no_grad()
def materialize(model: nn.Module, weights: MetaWeights | None, *, device: torch.device) -> None:
    """Allocate this rank's shards of `model` (meta, parallelized) on `device` and fill them
    from `weights`; None leaves them uninitialised (a checkpoint is loaded into them next)."""
    buffers = [
        (module, name, b)
        for _, module in model.named_modules(remove_duplicate=False)
        for name, b in module._buffers.items()
        if b is not None
    ]
    ties = _ties(model)
    model.to_empty(device=device)
    # ``to_empty`` gives each module its own new parameter: weights tied by sharing one (the
    # lm_head and the embeddings) are tied again, to the one FSDP registered (its first module)
    for module, name, owner, owner_name in ties:
        module._parameters[name] = owner._parameters[owner_name]
    # buffers (rotary frequencies) were computed for real at the build: put back
    for module, name, b in buffers:
        if b.is_meta:
            raise ValueError(f"buffer {name} of {type(module).__name__} was built on meta")
        if module._buffers.get(name) is not None:
            module._buffers[name] = b.to(device)
    if weights is None:
        return
    targets = {}
    persistent = set(weights.persistent_buffers)  # pretrained: read from the files as well
    for name, b in model.named_buffers():
        if plain_name(name) in persistent:
            targets[plain_name(name)] = whole(b)
    for name, p in model.named_parameters():
        targets[plain_name(name)] = shard_target(p)
    weights.fill(targets)


def host_peak_gib() -> float:
    """This process's peak resident memory so far (``VmHWM``), in GiB; 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def load_record(device: torch.device) -> dict[str, float]:
    """The run log's ``load`` record: the largest `host_peak_gib` of any rank once the models
    are built and filled (and a checkpoint loaded), before the first step; collective."""
    peak = torch.tensor([host_peak_gib()], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {"load/host_peak_gib": round(float(peak.item()), 4)}
