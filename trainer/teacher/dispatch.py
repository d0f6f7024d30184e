"""The feed: microbatches from the data stream to the teacher sources, one step ahead.

`open_teachers` opens one source per distillation term on this rank: a `LiveTeacher` over a
channel (worker process or in-process), a `CachedTeacher` or a `ServedTeacher`; both take a microbatch and hand
back its outputs, so the `Feed` treats them alike and submits each microbatch as soon as a live
teacher's slot is free, across step boundaries too. The cp and tp ranks of a dp group share
their microbatch's rows between their teachers (`SharedBatchTeacher`), so no row is computed
twice.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenbridge.dist_ops.collectives import group_rank, group_size
from trainer.config.schema import TrainConfig
from trainer.data.microbatches import Microbatch
from trainer.loss_terms import KDTerm
from trainer.teacher.cached_teacher import CachedTeacher
from trainer.teacher.channel import ChannelConfig, Received, TeacherChannel, starting_together
from trainer.teacher.model_program import TeacherModelProgram
from trainer.teacher.served_teacher import ServedTeacher, client_for
from trainer.teacher.worker import TeacherGroup


class LiveTeacher:
    """A channel as a feed source: a microbatch in, its term's teacher inputs (ids, mask, the
    used positions: `KDTerm.teacher_inputs`) submitted."""

    def __init__(self, channel: TeacherChannel, term: KDTerm):
        self.channel, self.term = channel, term

    @property
    def depth(self) -> int:
        return self.channel.config.depth

    def submit(self, mb: Microbatch, prep) -> None:
        self.channel.submit(self.term.teacher_inputs(mb, prep))

    def receive(self) -> Received:
        return self.channel.receive()

    def close(self) -> None:
        self.channel.close()


@dataclass
class GatheredReceived:
    """A microbatch's outputs gathered over the ranks sharing it (`SharedBatchTeacher`): the
    tensors are the caller's, so releasing is a no-op."""

    outputs: dict[str, torch.Tensor]
    teacher_s: float  # this rank's teacher, on its share of the rows

    def release(self) -> None:
        pass


class SharedBatchTeacher:
    """A live teacher of one of the ranks that hold the same microbatch (the student's cp x tp
    ranks of a dp group: cp ranks hold other positions of the same rows, tp ranks the same
    tokens).

    Rank r of that group submits only its share of the rows (rows [r m, (r + 1) m),
    m = ceil(B / size); a short share repeats the last row) and the outputs are all-gathered
    over the group back into whole rows: each row is computed by one teacher instead of cp x tp
    of them. What is gathered is the small per-position record (top-k, columns, masses), never
    logits; the loss then reads the whole record as from an unshared teacher.
    """

    def __init__(self, source: LiveTeacher, group, *, size: int, rank: int):
        self.source, self.group = source, group
        self.size, self.rank = size, rank
        self._rows: deque[int] = deque()  # B of each microbatch in flight, in order

    @property
    def depth(self) -> int:
        return self.source.depth

    def share(self, rows: int) -> torch.Tensor:
        """The row indices this rank's teacher computes, of a microbatch of `rows`."""
        m = -(-rows // self.size)
        return torch.arange(self.rank * m, (self.rank + 1) * m).clamp_(max=rows - 1)

    def submit(self, mb: Microbatch, prep) -> None:
        inputs = self.source.term.teacher_inputs(mb, prep)
        rows = inputs["input_ids"].shape[0]
        idx = self.share(rows).to(inputs["input_ids"].device)
        self.source.channel.submit({k: v.index_select(0, idx) for k, v in inputs.items()})
        self._rows.append(rows)

    def receive(self) -> GatheredReceived:
        rows = self._rows.popleft()
        with self.source.receive() as r:
            # the same field order on every rank: the gathers pair up
            outputs = {k: self._gather(r.outputs[k])[:rows] for k in sorted(r.outputs)}
            return GatheredReceived(outputs, r.teacher_s)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts)

    def close(self) -> None:
        self.source.close()


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
                for source, prep in zip(self.sources, q.prep):
                    source.submit(q.mb, prep)
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
    batch_group=None,
    dtypes: tuple[str, ...],
) -> list:
    """One teacher source per KD term on this rank: its cache when ``caches[i]`` is given
    (`CachedTeacher`), its server when ``teachers[i].server`` is (`ServedTeacher`), else a worker process (or in-process, for debugging) that runs the
    teacher one microbatch ahead (`LiveTeacher`; when ``batch_group``, the ranks holding the
    same microbatch, has more than one rank, a `SharedBatchTeacher` computing this rank's share
    of its rows). `max_len[i]` bounds teacher i's rows; `dtypes[i]`: teacher i's dtype on this
    device (``teachers[i].dtype`` resolved, `trainer.config.precision`)."""
    channels: list[TeacherChannel] = []
    sources: list = []
    with starting_together(channels):
        for term in terms:
            t_cfg = cfg.teachers[term.index]
            cache = caches[term.index] if caches else None
            if cache is not None:
                sources.append(CachedTeacher(cache, term.spec, index=term.index, device=device))
                continue
            if t_cfg.server:  # scored by its server, one microbatch ahead (no process, no ring)
                sources.append(ServedTeacher(client_for(t_cfg), term.spec, index=term.index,
                                             device=device, depth=cfg.parallel.channel_slots))  # fmt: skip
                continue
            program = TeacherModelProgram(
                t_cfg,
                term.spec,
                columns=term.columns(),
                max_batch=cfg.data.micro_batch_size,
                max_len=max_len[term.index],
                dtype=dtypes[term.index],
                used_mask=True,  # outputs only where the loss reads them (`KDTerm.teacher_inputs`)
                packed=cfg.data.packing,
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
            source = LiveTeacher(channel, term)
            if group_size(batch_group) > 1:
                source = SharedBatchTeacher(
                    source, batch_group, size=group_size(batch_group), rank=group_rank(batch_group)
                )
            sources.append(source)
    return sources
