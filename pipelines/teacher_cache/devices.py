"""Which GPU a teacher-cache worker loads its model on: one model per GPU, never all on GPU 0.

With ``--device cuda`` (no index) each worker process picks from what it knows about itself
(`choose_device`, pure): the one GPU it sees (``CUDA_VISIBLE_DEVICES=3``, how a Dask worker is
pinned), else the number in its worker id (Beam's ``WORKER_ID``, a Dask worker named ``gpu-3``),
round robin over the visible GPUs. ``cuda:N`` is kept as given. Not run on GPUs here.
"""

from __future__ import annotations

import os
import re

_TRAILING_NUMBER = re.compile(r"(?:^|[^0-9])(\d+)$")


def worker_index(worker_id: str | int | None) -> int | None:
    """The number at the end of a worker id (``worker_3`` -> 3, ``gpu-1`` -> 1, 2 -> 2); None
    for none, or for an address (a Dask worker's default name ends in its port)."""
    if worker_id is None:
        return None
    text = str(worker_id)
    if "://" in text:
        return None
    m = _TRAILING_NUMBER.search(text)
    return int(m.group(1)) if m else None


def choose_device(
    requested: str, *, worker_id: str | int | None, visible: str | None, device_count: int
) -> str:
    """The device this worker loads the teacher on. `requested` is ``--device``; `visible` is
    ``CUDA_VISIBLE_DEVICES`` (None when unset); `device_count` the GPUs torch sees."""
    if requested != "cuda":
        return requested  # cpu, or a GPU the user named
    shown = [d for d in (visible or "").split(",") if d.strip()]
    count = len(shown) if visible is not None else device_count
    if count <= 1:
        return "cuda:0"
    index = worker_index(worker_id)
    return f"cuda:{0 if index is None else index % count}"


def this_worker_id() -> str | int | None:
    """This process's worker id: Beam's SDK workers carry ``WORKER_ID``; a Dask worker has its
    name (Beam's DaskRunner runs the DoFns inside it)."""
    if os.environ.get("WORKER_ID"):
        return os.environ["WORKER_ID"]
    try:
        from distributed import get_worker

        return get_worker().name
    except (ImportError, ValueError):  # not inside a Dask worker
        return None


def worker_device(requested: str) -> str:
    """`choose_device` for this process (torch's GPU count read only for ``cuda``)."""
    if requested != "cuda":
        return requested
    import torch

    return choose_device(
        requested,
        worker_id=this_worker_id(),
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device_count=torch.cuda.device_count(),
    )
