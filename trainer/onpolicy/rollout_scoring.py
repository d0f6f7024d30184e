"""Teachers score rollouts in their workers, through the same logit channel as off-policy KD.

An on-policy teacher is the same channel program as an off-policy one
(`trainer.teacher.model_program.TeacherModelProgram`, hence the one `teacher_forward`): its
spec may ask for the teacher's log-probs at the student's own top-k ids, which travel in the
slot with the rows (``col_ids`` [B, U, K], -1 = none). Every on-policy spec also carries the
teacher's log-prob of each realised token (``target_logprob``, `scoring_spec`): sampled-token
reverse KL and the chain losses read it, and the held-out eval turns it into the teacher's bits
per byte of the student's own text. Only the positions those read are scored (``used_mask``,
`trainer.loss_terms.used_inputs`): the prompt is the teacher's context, not its output.

`open_scorers` starts one channel per on-policy teacher on this rank (worker process, or
in-process for debugging), with as many slots as a step has microbatches: outputs are copied out
of their slot when received, so a slot is free again before the next submit and the teacher can
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
