"""A local ``checkpoint.dir`` used by several nodes must be one directory that they all share.

Every rank writes its part of a checkpoint into the step's directory, which rank 0 creates and
later publishes; on nodes that each have their own disk, rank 1 finds no such directory and the
run dies at its first checkpoint, its steps lost. So it is checked once at start, before any
model loads (`check_shared`, collective): rank 0 writes a probe file into the directory, and
every rank must see it. A node that does not is refused in one line (`NotSharedError`) naming
its ranks and what to use instead: a directory every node mounts, or an ``s3://`` URL.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from pathlib import Path

import torch.distributed as dist

from tokenbridge import cli, urls
from trainer.config.checks import ConfigError

PROBE = ".tokenbridge-shared-probe-"


class NotSharedError(ConfigError):
    """``checkpoint.dir`` is not the same directory on every node (named in the message)."""


def check_shared(folder: Path | str, *, where: str = "checkpoint.dir") -> None:
    """Refuse a local `folder` that not every rank of the process group sees as rank 0 does
    (collective; nothing to check for one process or an object-store URL)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or urls.is_url(folder):
        return
    folder = Path(folder)
    rank, world = dist.get_rank(), dist.get_world_size()
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = folder / f"{PROBE}{token[0]}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    dist.barrier()
    seen = [None] * world
    dist.all_gather_object(seen, (probe.is_file(), socket.gethostname()))
    dist.barrier()
    if rank == 0:
        with contextlib.suppress(OSError):
            probe.unlink()
    blind = [r for r, (ok, _) in enumerate(seen) if not ok]
    if blind:
        hosts = sorted({seen[r][1] for r in blind})
        raise cli.same_on_every_rank(  # every rank raises it: rank 0 says it
            NotSharedError(
                f"config {where}={folder}: not shared by every node: ranks {blind} (on {hosts}) "
                f"do not see the file rank 0 wrote there ({probe.name}); each node would write its "
                "own part of every checkpoint into a directory the others cannot see. Use a "
                "directory every node mounts, or an s3:// URL"
            )
        )
