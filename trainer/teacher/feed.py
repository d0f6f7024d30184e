"""The feed: microbatches from the data stream to the teacher channels, one step ahead.

``open_teachers`` opens one teacher source per distillation term on this rank: a
`TeacherChannel` to a worker process running `TeacherModelProgram` (or in-process, for
debugging), wrapped as a `LiveTeacher`, or a `CachedTeacher` reading an offline cache
(``teachers[i].cache``; `trainer.teacher.cache`). Both take a microbatch (``submit``) and hand
back its outputs (``receive``), so the feed treats them alike. ``Feed`` draws microbatches from
the loader into a small queue, prepares each term's per-microbatch input (its chunk index or
mask: counts are known before any forward) and submits them as soon as a live teacher's ring
slot is free, so the teacher computes microbatch i+1 while the student steps on microbatch i,
across step boundaries too. A checkpoint records the data position before the first
queued-but-unused microbatch (``position``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.data import Microbatch
from trainer.distill import KDTerm
from trainer.teacher.cache import CachedTeacher
from trainer.teacher.channel import ChannelConfig, Received, TeacherChannel
from trainer.teacher.program import TeacherModelProgram
from trainer.teacher.worker import TeacherGroup


class LiveTeacher:
    """A channel as a feed source: a microbatch in, its teacher inputs (ids, mask) submitted."""

    def __init__(self, channel: TeacherChannel, index: int):
        self.channel, self.index = channel, index

    @property
    def depth(self) -> int:
        return self.channel.config.depth

    def submit(self, mb: Microbatch) -> None:
        self.channel.submit(mb.teacher_inputs(self.index))

    def receive(self) -> Received:
        return self.channel.receive()

    def close(self) -> None:
        self.channel.close()


@dataclass
class Queued:
    """A microbatch waiting in the feed: where the data stream was before it (what a checkpoint
    records while it is unused), its per-term preparation, and whether the teacher has it."""

    position: dict
    mb: Microbatch
    prep: list = dataclasses.field(default_factory=list)
    submitted: bool = False


class Feed:
    """Microbatches from the loader, handed to the teacher channels as soon as a ring slot is free,
    so the teacher computes microbatch i+1 while the student steps on microbatch i (and runs
    across step boundaries too)."""

    def __init__(self, loader, terms: list[KDTerm], sources: list, *, device):
        self.loader, self.terms, self.sources, self.device = loader, terms, sources, device
        # live teachers bound how far ahead the feed runs; a cache source has no ring
        depths = [s.depth for s in sources if s.depth is not None]
        self.depth = min(depths) if depths else 1
        self.queue: deque[Queued] = deque()

    def _fill(self, n: int) -> None:
        while len(self.queue) < max(n, self.depth):
            position = self.loader.state_dict()
            mb = next(self.loader).to(self.device)
            self.queue.append(Queued(position, mb, [t.prepare(mb) for t in self.terms]))
        in_flight = sum(q.submitted for q in self.queue)
        for q in self.queue:
            if not self.sources or in_flight >= self.depth:
                break
            if not q.submitted:
                for source in self.sources:
                    source.submit(q.mb)
                q.submitted, in_flight = True, in_flight + 1

    def peek(self, n: int) -> list[Queued]:
        """The next `n` microbatches (loaded, prepared; counts can be taken before any forward)."""
        self._fill(n)
        return [self.queue[i] for i in range(n)]

    def next(self) -> tuple[Queued, list]:
        """The next microbatch and its teachers' outputs (`Received` or `CachedReceived`:
        release them after use)."""
        self._fill(1)
        q = self.queue.popleft()
        # with 2 slots the teacher now works on the next microbatch while the caller steps on this
        # one; this slot is free again once the caller releases `received`
        received = [source.receive() for source in self.sources]
        return q, received

    def position(self) -> dict:
        """The data position before the first unused microbatch."""
        return self.queue[0].position if self.queue else self.loader.state_dict()

    def reset(self) -> None:
        """Forget queued microbatches (after loading a checkpoint; the teacher is idle then)."""
        if any(q.submitted for q in self.queue):
            raise RuntimeError("cannot reset the feed while the teacher holds microbatches")
        self.queue.clear()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def open_teachers(
    cfg: TrainConfig,
    terms: list[KDTerm],
    *,
    device: torch.device,
    rank: int,
    world: int,
    max_len: list[int],
    threads: int | None,
    caches: list | None = None,
) -> list:
    """One teacher source per KD term on this rank: its cache when ``caches[i]`` is given
    (`CachedTeacher`), else a worker process (or in-process, for debugging) that runs the
    teacher one microbatch ahead (`LiveTeacher`). `max_len[i]` bounds teacher i's rows."""
    channels: list[TeacherChannel] = []
    sources: list = []
    try:
        for term in terms:
            t_cfg = cfg.teachers[term.index]
            cache = caches[term.index] if caches else None
            if cache is not None:
                sources.append(CachedTeacher(cache, term.spec, index=term.index, device=device))
                continue
            program = TeacherModelProgram(
                t_cfg,
                term.spec,
                columns=term.columns(),
                max_batch=cfg.data.micro_batch_size,
                max_len=max_len[term.index],
                dtype=t_cfg.dtype,
            )
            inprocess = cfg.parallel.teacher_placement == "inprocess"
            group = None
            if not inprocess and t_cfg.tp > 1:
                # the teachers' own group: rank 0 picks the rendezvous, every rank joins it
                addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
                box = [f"tcp://{addr}:{_free_port()}" if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                backend = "nccl" if device.type == "cuda" else "gloo"
                group = TeacherGroup(box[0], world, rank, backend=backend)
            ch_cfg = ChannelConfig(
                mode="inprocess" if inprocess else "process",
                depth=cfg.parallel.channel_slots,
                timeout_s=cfg.parallel.teacher_timeout_s,
                worker_threads=threads,
            )
            channel = TeacherChannel(program, device=device, config=ch_cfg, group=group)
            channels.append(channel)
            sources.append(LiveTeacher(channel, term.index))
        for ch in channels:
            ch.wait_ready()
    except BaseException:
        for ch in channels:
            ch.close()
        raise
    return sources
