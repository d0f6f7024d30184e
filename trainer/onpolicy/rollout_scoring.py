"""Teachers score rollouts in their workers, through the same logit channel as off-policy KD,
or on their servers (``teachers[i].server``).

An on-policy teacher runs the off-policy teachers' own program (`TeacherModelProgram`, the one
`teacher_forward`), scoring only the positions that predict a completion token (``used_mask``),
and always ships the log-prob of each realised token as well (`scoring_spec`). A channel has one
slot per microbatch of a step and outputs are copied out when received, so the teachers can
score step i + 1 while the student learns on step i (``onpolicy.lag: 1``). A served teacher
(`ServedScorer`) takes the same calls: each rollout's teacher ids go to its server as one row
(every real position scored: a server has no used mask), in a background thread.
"""

from __future__ import annotations

import torch

from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec
from trainer.config.schema import TeacherConfig
from trainer.teacher.channel import ChannelConfig, TeacherChannel, starting_together
from trainer.teacher.model_program import TeacherModelProgram
from trainer.teacher.served_teacher import ServedTeacher, client_for


def scoring_spec(spec: TeacherOutputSpec) -> TeacherOutputSpec:
    """A mode's teacher spec plus the realised token's log-prob (eval and chain losses)."""
    extra = TeacherOutputSpec(spec.vocab_size, target=True, temperature=spec.temperature)
    return spec.union(extra)


class ServedScorer:
    """A served teacher behind a channel's calls (`submit`, `done`, `receive`, `close`): the
    rows of each submitted microbatch are scored by its server while the caller goes on."""

    remote = True  # computes elsewhere: submitting early costs this machine's cores nothing

    def __init__(self, feed: ServedTeacher, *, depth: int):
        self.feed = feed
        # no ring, but its depth bounds what `OnPolicy.score_all` keeps in flight, as slots do
        self.config = ChannelConfig(mode="inprocess", depth=depth)

    def submit(self, inputs: dict[str, torch.Tensor]) -> None:
        # right-padded rows: the real ones end where the attention mask does
        self.feed.submit_rows(inputs["input_ids"], inputs["attention_mask"].sum(1))

    def wait_ready(self) -> None:
        return None  # the preflight checked the server (`open_served`)

    def done(self) -> bool:
        return self.feed.done()

    def receive(self):
        return self.feed.receive()

    def close(self) -> None:
        self.feed.close()


def open_scorers(
    teachers: list[TeacherConfig],
    specs: list[TeacherOutputSpec],
    *,
    indices: list[int],
    device: torch.device,
    max_batch: int,
    max_len: list[int],
    depth: int,
    inprocess: bool,
    timeout_s: float,
    threads: int | None,
    dtypes: list[str],
) -> list[TeacherChannel | ServedScorer]:
    """One started channel per teacher (closed again if any fails to start), a `ServedScorer`
    for a served one; `indices`: their places in ``teachers``' config; `dtypes`: each one's
    dtype on this device (``teachers[i].dtype`` resolved, `trainer.config.precision`)."""
    channels: list = []
    with starting_together(channels):
        for index, t_cfg, spec, length, dtype in zip(indices, teachers, specs, max_len, dtypes):
            if t_cfg.server:
                feed = ServedTeacher(client_for(t_cfg), spec, index=index, device=device,
                                     depth=depth)  # fmt: skip
                channels.append(ServedScorer(feed, depth=depth))
                continue
            program = TeacherModelProgram(
                t_cfg, spec, max_batch=max_batch, max_len=length, dtype=dtype, used_mask=True
            )
            cfg = ChannelConfig(
                mode="inprocess" if inprocess else "process",
                depth=depth,
                timeout_s=timeout_s,
                worker_threads=threads,
            )
            channels.append(TeacherChannel(program, device=device, config=cfg))
    return channels


def receive_copy(channel: TeacherChannel | ServedScorer) -> tuple[TeacherOutputs, float]:
    """The oldest submitted microbatch's outputs, copied out of the ring (the slot is released
    at once) and the teacher's seconds on it."""
    with channel.receive() as got:
        outs = TeacherOutputs(**{k: v.clone() for k, v in got.outputs.items()})
        return outs, got.teacher_s


def scored(channels: list[TeacherChannel | ServedScorer]) -> bool:
    """Have the teachers finished every microbatch submitted to them (never waits)?"""
    return all(ch.done() for ch in channels)
