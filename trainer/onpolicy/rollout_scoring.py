"""Teachers score rollouts in their workers, through the same logit channel as off-policy KD.

An on-policy teacher runs the off-policy teachers' own program (`TeacherModelProgram`, the one
`teacher_forward`), scoring only the positions that predict a completion token (``used_mask``),
and always ships the log-prob of each realised token as well (`scoring_spec`). A channel has one
slot per microbatch of a step and outputs are copied out when received, so the teachers can
score step i + 1 while the student learns on step i (``onpolicy.lag: 1``).
"""

from __future__ import annotations

import torch

from tokenbridge.teacher.outputs import TeacherOutputs, TeacherOutputSpec
from trainer.config.schema import TeacherConfig
from trainer.teacher.channel import ChannelConfig, TeacherChannel, starting_together
from trainer.teacher.model_program import TeacherModelProgram


def scoring_spec(spec: TeacherOutputSpec) -> TeacherOutputSpec:
    """A mode's teacher spec plus the realised token's log-prob (eval and chain losses)."""
    extra = TeacherOutputSpec(spec.vocab_size, target=True, temperature=spec.temperature)
    return spec.union(extra)


def open_scorers(
    teachers: list[TeacherConfig],
    specs: list[TeacherOutputSpec],
    *,
    device: torch.device,
    max_batch: int,
    max_len: list[int],
    depth: int,
    inprocess: bool,
    timeout_s: float,
    threads: int | None,
    dtypes: list[str],
) -> list[TeacherChannel]:
    """One started channel per teacher (closed again if any fails to start); `dtypes`: each
    one's dtype on this device (``teachers[i].dtype`` resolved, `trainer.config.precision`)."""
    channels: list[TeacherChannel] = []
    with starting_together(channels):
        for t_cfg, spec, length, dtype in zip(teachers, specs, max_len, dtypes):
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


def receive_copy(channel: TeacherChannel) -> tuple[TeacherOutputs, float]:
    """The oldest submitted microbatch's outputs, copied out of the ring (the slot is released
    at once) and the teacher's seconds on it."""
    with channel.receive() as got:
        outs = TeacherOutputs(**{k: v.clone() for k, v in got.outputs.items()})
        return outs, got.teacher_s


def scored(channels: list[TeacherChannel]) -> bool:
    """Have the teachers finished every microbatch submitted to them (never waits)?"""
    return all(ch.done() for ch in channels)
