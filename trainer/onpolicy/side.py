"""The on-policy side of a run: prompts -> the student samples -> each teacher scores -> learn.

An on-policy step (`OnPolicy.step`) is the one training step (`trainer.step.TrainStep`) run on
the student's own rollouts instead of shard batches; the loop takes one with probability
``onpolicy.lmbda`` (GKD's lambda, drawn alike on every rank and checkpointed). With
``onpolicy.lag: 1`` the next step's rollouts are sampled while the teachers score this step's;
the pending rollouts are checkpointed, so a resumed run learns on exactly what the
uninterrupted one would (docs/onpolicy.md, "A step" and "Policy lag and mixing").
"""

from __future__ import annotations

import functools
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tokenbridge.teacher.outputs import TeacherOutputs
from tokenbridge.tokenizers import Tokenizer
from trainer.config.schema import DataConfig, OnPolicyConfig, ParallelConfig, TrainConfig
from trainer.data.microbatches import MicrobatchLoader
from trainer.loss_terms import kd_weights, used_inputs
from trainer.onpolicy.agreement import completion_bpb
from trainer.onpolicy.packed_rollouts import pack_rollouts
from trainer.onpolicy.prompts import ChatPrompts, PromptSource, TextPrompts
from trainer.onpolicy.rollout_scoring import open_scorers, receive_copy, scored
from trainer.onpolicy.rollout_source import RolloutSource
from trainer.onpolicy.rollouts import RolloutBatch, build_batch, completion_rows
from trainer.onpolicy.sampling import orient
from trainer.onpolicy.sampling.decode import int8_weights
from trainer.onpolicy.sampling.sampler import (
    Rollouts,
    SamplingConfig,
    ThreadRelease,
    gathered,
    sample,
)
from trainer.onpolicy.teachers import (
    OnPolicyTeachers,
    build_teachers,
    rollout_max_len,
    teacher_max_len,
)
from trainer.parallel.cpus import CpuPlan, torch_threads
from trainer.parallel.mesh import ParallelGroups
from trainer.step import TrainStep
from trainer.throughput import Throughput

if TYPE_CHECKING:
    from trainer.preflight import Prepared


def _microbatches(config: OnPolicyConfig) -> tuple[int, int]:
    """(rollouts per microbatch, microbatches per step) of this rank."""
    per_step = config.prompts_per_step * config.n_samples
    size = config.micro_batch_size or per_step
    return size, per_step // size


def open_onpolicy(
    cfg: TrainConfig,
    prepared: Prepared,
    *,
    model: torch.nn.Module,
    mesh: ParallelGroups,
    loader: MicrobatchLoader,
    stepper: TrainStep,
    throughput: Throughput,
    cpus: CpuPlan,
    device: torch.device,
) -> OnPolicy:
    """The on-policy side of a run (built by `trainer.loop.Trainer`, after the shard side): its
    prompts, its teachers' terms and views and their started channels, from the config and what
    the preflight loaded."""
    op = cfg.onpolicy
    student = prepared.student_tok
    ranks = {"dp_rank": mesh.dp_rank, "dp_size": mesh.dp_size, "seed": op.seed}
    prompts: PromptSource
    if op.prompts == "text":
        reader = loader.stream.reader
        prompts = TextPrompts(reader, data=cfg.data, prompt_tokens=op.prompt_tokens, **ranks)
        chat = None
    else:
        prompts = ChatPrompts(op.chat_data, student, data=cfg.data, model_dir=cfg.model.path,
                              template=op.chat_template or None, **ranks)  # fmt: skip
        chat = prompts.side
    max_len = rollout_max_len(cfg)
    teachers = build_teachers(
        cfg, student=student, teachers=prepared.teacher_toks, student_chat=chat, max_len=max_len
    )
    size, n_mb = _microbatches(op)
    channels = open_scorers(
        [cfg.teachers[t.index] for t in teachers.terms],
        [t.spec for t in teachers.terms],
        indices=[t.index for t in teachers.terms],
        device=device,
        max_batch=size,
        max_len=teacher_max_len(teachers.views, max_len),
        depth=n_mb,
        inprocess=cfg.parallel.teacher_placement == "inprocess",
        timeout_s=cfg.parallel.teacher_timeout_s,
        threads=cpus.worker,
        dtypes=[prepared.precision.teacher_dtypes[t.index] for t in teachers.terms],
    )
    return OnPolicy(
        config=op,
        prompts=prompts,
        teachers=teachers,
        channels=channels,
        model=model,
        mesh=mesh,
        student=student,
        loader=loader,
        stepper=stepper,
        throughput=throughput,
        data=cfg.data,
        parallel=cfg.parallel,
        overlap_threads=cpus.overlap,
        device=device,
        max_len=max_len,
    )


class OnPolicy:
    """The on-policy side of one run (see the module docstring; built by `open_onpolicy`).

    ``config``: ``onpolicy``; ``teachers``: their terms, views and ``channels``; ``student``:
    its tokenizer; ``loader``: the shard side's (the pad id, the epoch the records show);
    ``stepper``: the one step; ``overlap_threads``: the student's threads while its teacher
    workers compute (`trainer.parallel.cpus`); ``max_len``: the longest rollout row
    (`rollout_max_len`)."""

    def __init__(
        self,
        *,
        config: OnPolicyConfig,
        prompts: PromptSource,
        teachers: OnPolicyTeachers,
        channels: list,
        model: torch.nn.Module,
        mesh: ParallelGroups,
        student: Tokenizer,
        loader: MicrobatchLoader,
        stepper: TrainStep,
        throughput: Throughput,
        data: DataConfig,
        parallel: ParallelConfig,
        overlap_threads: int | None,
        device: torch.device,
        max_len: int,
    ):
        self.config, self.prompts, self.teachers, self.channels = (
            config,
            prompts,
            teachers,
            channels,
        )
        self.model, self.student, self.loader = model, student, loader
        self.stepper, self.throughput = stepper, throughput
        self.data, self.parallel, self.device = data, parallel, device
        self.overlap_threads = overlap_threads
        self.sampling = SamplingConfig(
            temperature=config.temperature,
            top_p=config.top_p,
            max_new_tokens=config.max_new_tokens,
            n_samples=config.n_samples,
            record_topk=teachers.topk,
            weights=config.sampler_weights,
        )
        self.mb, self.n_mb = _microbatches(config)
        self.choice = random.Random(f"{config.seed}/lmbda")  # the same draw on every rank
        self.pending: Rollouts | None = None  # lag 1: sampled and submitted, not learnt yet
        # int8 sampling: the copy and the rollout phases it has served (not checkpointed: a
        # resumed run makes a new one, so with sampler_refresh > 1 its rollouts may differ)
        self.int8, self.int8_uses, self.int8_copy_s = None, 0, 0.0  # seconds making copies
        self.overlap_s = 0.0  # lag 1: seconds the last rollout phase sampled beside the teachers
        self._pending_batches: list | None = None
        self.mixture = config.mix == "mixture" and len(teachers.terms) > 1
        # the step's KD terms: the teachers' own, or one on their mixture (weighted inside)
        terms = teachers.terms
        weights = torch.ones(1, dtype=torch.float64) if self.mixture else kd_weights(terms)
        self.kd_weights = weights.to(device)  # on the device once, as `ShardSource`'s
        self.tp_group = mesh.tp if mesh.tp_size > 1 else None
        # data.packing: the student's forward packs each microbatch's rollouts into rows of
        # this many tokens (data.packed_tokens, or the longest rollout's when that is longer:
        # every rollout fits a row alone); 0: padded rows
        self.pack_tokens = max(data.row_tokens, max_len) if data.packing else 0

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    # -------------------------------------------------------------------------------------
    # the phases

    def takes_step(self) -> bool:
        """Is the next step on-policy? (One draw per step, alike on every rank.)"""
        return self.choice.random() < self.config.lmbda

    def seeds(self, prompts, salt: str = "") -> list[int]:
        """One sampling seed per rollout, from what it is (run seed, prompt, its draw, sample
        index): the same completion in any layout, batch or resumed run (`sampler`)."""
        return [
            zlib.crc32(f"{self.config.seed}/{salt}{p.key}/{p.draw}/{s}".encode())
            for p in prompts
            for s in range(self.config.n_samples)
        ]

    def generate(
        self,
        prompts=None,
        *,
        salt: str = "",
        threads: int | None = None,
        release: Callable[[], bool] | None = None,
        exact: bool = False,
    ) -> Rollouts:
        """Rollouts of this rank's next prompts (or of ``prompts``) with the current weights;
        ``threads``: torch's threads meanwhile (None: unchanged), until ``release()`` (polled
        before each decode step) says the work beside it is over, then torch's threads again;
        ``exact``: the model's own weights even where ``onpolicy.sampler_weights`` is int8 (the
        eval's completions)."""
        if prompts is None:
            prompts = self.prompts.next_prompts(self.config.prompts_per_step)
        model = self.model
        was_training = model.training
        model.eval()
        on_step, cores = None, torch.get_num_threads()
        if release is not None and threads is not None:
            on_step = ThreadRelease(release, threads=cores)
        try:
            with (
                torch_threads(threads),
                gathered(model, reshard_after_forward=self.parallel.reshard_after_forward),
            ):
                # the copy packs a matrix per Python thread, each at torch's lowered count: on
                # every core even beside the teachers (on one, it outlasted their scoring)
                int8 = None if exact else self._int8_copy(model, threads=cores)
                r = sample(
                    model,
                    [p.ids for p in prompts],
                    config=replace(self.sampling, weights="model") if exact else self.sampling,
                    seeds=self.seeds(prompts, salt),
                    stop_ids=self.teachers.stop_ids,
                    vocab_size=self.student.vocab_size,
                    tp_group=self.tp_group,
                    int8=int8,
                    on_step=on_step,
                )
        finally:
            model.train(was_training)
        if on_step is not None:
            self.overlap_s = on_step.held()
        r.meta = [{"key": prompts[i].key, "messages": prompts[i].messages} for i in r.prompt_index]
        return r

    def _int8_copy(self, model, *, threads: int):
        """The int8 copy this rollout phase samples from (None: the model's own weights): a new
        one every ``onpolicy.sampler_refresh`` phases, packed on ``threads`` threads."""
        if self.sampling.weights != "int8":
            return None
        if self.int8 is None or self.int8_uses >= self.config.sampler_refresh:
            t0 = time.perf_counter()
            self.int8 = None  # the old copy freed first: never two at once
            self.int8 = int8_weights(model, vocab_size=self.student.vocab_size, threads=threads)
            self.int8_uses = 0
            self.int8_copy_s += time.perf_counter() - t0
        self.int8_uses += 1
        return self.int8

    def batches(self, r: Rollouts) -> list[tuple[RolloutBatch, list]]:
        """The rollouts' microbatches and each term's preparation (its mask or chunk index),
        each teacher's inputs with the positions its outputs are read at (`used_inputs`)."""
        out = []
        for m in range(-(-len(r) // self.mb)):
            rows = list(range(m * self.mb, min(len(r), (m + 1) * self.mb)))
            b = build_batch(
                r,
                rows,
                student=self.student,
                teachers=self.teachers.views,
                want_cols=[t.spec.per_position_columns for t in self.teachers.terms],
                pad_id=self.loader.student_pad,
                pad_to_multiple=self.data.pad_to_multiple,
            )
            if self.pack_tokens:
                b.packed = pack_rollouts(
                    b.input_ids_BT,
                    b.attention_mask_BT.sum(1).tolist(),
                    row_tokens=self.pack_tokens,
                    buffer=self.data.pack_buffer,
                    pad_id=self.loader.student_pad,
                    pad_to_multiple=self.data.pad_to_multiple,
                )
            b = b.to(self.device)
            preps = [
                t.record.prepare(b.aligned[j], b.targets_BT)
                for j, t in enumerate(self.teachers.terms)
            ]
            for j, t in enumerate(self.teachers.terms):
                inputs = b.teacher_inputs[j]
                done = completion_rows(b.aligned[j], inputs["input_ids"].shape[1])
                b.teacher_inputs[j] = used_inputs(t.record, preps[j], inputs, completion=done)
            out.append((b, preps))
        return out

    def submit(self, batches: list[tuple[RolloutBatch, list]], *, remote: bool | None = None):
        """The batches to every teacher, or to the served ones (``remote``) or the others."""
        for b, _ in batches:
            for ch, inputs in zip(self.channels, b.teacher_inputs):
                if remote is None or getattr(ch, "remote", False) == remote:
                    ch.submit(inputs)

    def score_all(self, batches) -> list[list[TeacherOutputs]]:
        """Every microbatch's outputs, however many: at most a ring's worth in flight."""
        outs: list[list[TeacherOutputs]] = []
        depth = self.channels[0].config.depth
        for m, (b, _) in enumerate(batches):
            if m >= depth:
                outs += self.receive(1)[0]
            for ch, inputs in zip(self.channels, b.teacher_inputs):
                ch.submit(inputs)
        return outs + self.receive(len(batches) - len(outs))[0]

    def _timed_submit(self, batches, times: Counter, *, remote: bool | None = None) -> None:
        # in-process teachers compute inside submit: their time is the teacher's, not align's
        t0 = time.perf_counter()
        self.submit(batches, remote=remote)
        times["submit_s"] += time.perf_counter() - t0

    def receive(self, n: int) -> tuple[list[list[TeacherOutputs]], float]:
        """The outputs of the next ``n`` microbatches, per microbatch per teacher."""
        outs, teacher_s = [], 0.0
        for _ in range(n):
            row = []
            for ch in self.channels:
                o, s = receive_copy(ch)
                row.append(o)
                teacher_s += s
            outs.append(row)
        return outs, teacher_s

    # -------------------------------------------------------------------------------------
    # the step

    def step(self, *, log: bool, last: bool) -> dict[str, float] | None:
        """One on-policy optimizer step (generate, align, score, learn: docs/onpolicy.md); its
        record on a logging step. ``last``: no later on-policy step will run in this process (lag 1 samples none)."""
        t0, copy0 = time.perf_counter(), self.int8_copy_s
        times = Counter()
        if self.pending is not None:  # lag 1: sampled and submitted during the last step
            r, batches = self.pending, self._pending_batches
            self.pending = self._pending_batches = None
        else:
            r = self.generate()
            times["generate_s"] += time.perf_counter() - t0
            times["gen_tokens"] += r.new_tokens
            t1 = time.perf_counter()
            batches = self.batches(r)
            times["align_s"] += time.perf_counter() - t1
            self._timed_submit(batches, times)
        nxt = None
        if self.config.lag == 1 and not last:
            # the next step's rollouts, sampled by these weights before they learn on `r`,
            # while the teachers score `r`; on CPU with the threads the workers leave free
            # (`trainer.parallel.cpus`) until they have finished, then on every core, and the
            # update below runs alone on every core
            t3 = time.perf_counter()
            # polled by the sampler: have the teachers finished every microbatch (never waits)?
            done = functools.partial(scored, self.channels)
            nxt = self.generate(threads=self.overlap_threads, release=done)
            times["generate_s"] += time.perf_counter() - t3
            times["overlap_s"] += self.overlap_s
            times["gen_tokens"] += nxt.new_tokens
            t4 = time.perf_counter()
            nxt_batches = self.batches(nxt)
            times["align_s"] += time.perf_counter() - t4
        t2 = time.perf_counter()
        outs, teacher_s = self.receive(len(batches))
        times["teacher_wait_s"] += time.perf_counter() - t2
        if nxt is not None:  # served teachers score it on their servers while the student learns
            self._timed_submit(nxt_batches, times, remote=True)
        t5 = time.perf_counter()
        record = self.stepper.run(self._source(r, batches, outs), log=log)
        times["student_s"] += time.perf_counter() - t5
        if nxt is not None:  # the workers score it while the student samples the step after
            self._timed_submit(nxt_batches, times, remote=False)
            self.pending, self._pending_batches = nxt, nxt_batches
        if record is None:
            return None
        gen_tokens = times.pop("gen_tokens", 0)
        if self.sampling.weights == "int8":  # of generate_s: packing the int8 copies
            times["int8_copy_s"] = self.int8_copy_s - copy0
        record.update({f"time/{k}": v for k, v in times.items()})
        if times["generate_s"] > 0:  # this rank's sampler speed over what it sampled this step
            record["rollout/gen_tokens_per_s"] = gen_tokens / times["generate_s"]
        record.update(teacher_s=teacher_s, step_s=time.perf_counter() - t0, onpolicy=1.0)
        record["tokens_per_s"] = record["tokens"] / record["step_s"]
        # per device; no FLOPs: the step's time went to sampling too, whose FLOPs are not counted
        record |= self.throughput.record(tokens=record["tokens"], step_s=record["step_s"], seq=None)
        return record

    def _source(self, r: Rollouts, batches, outs) -> RolloutSource:
        """The step's rollouts as the one step's microbatches."""
        return RolloutSource(
            r,
            batches,
            outs,
            model=self.model,
            terms=self.teachers.terms,
            mixture=self.mixture,
            weights=self.kd_weights,
            sampling=self.sampling,
            ratio_clip=self.config.ratio_clip,
            logits_chunk=self.parallel.logits_chunk,
            tp_group=self.tp_group,
            vocab_size=self.student.vocab_size,
            loader=self.loader,
            device=self.device,
        )

    # -------------------------------------------------------------------------------------
    # eval and state

    def evaluate(self) -> dict[str, float]:
        """The teachers' bits per byte of the student's own completions of the held-out prompts
        (sampled with a fixed seed, the same on every rank and every call)."""
        if not self.config.eval_prompts:
            return {}
        prompts = self.prompts.held_out(self.config.eval_prompts)
        if not prompts:
            return {}
        r = self.generate(prompts, salt="eval/", exact=True)
        batches = self.batches(r)
        outs = self.score_all(batches)
        names = [t.name for t in self.teachers.terms]
        return completion_bpb(batches, outs, names, student=self.student)

    def state_dict(self) -> dict:
        """This rank's on-policy position: prompts, the lambda RNG, pending rollouts (sampling
        needs no state: each rollout's seed is derived from what it is). Plain values and
        numpy arrays: a checkpoint stores them as JSON and tensors (trainer.checkpoint.state_split)."""
        return {
            "prompts": self.prompts.state_dict(),
            "choice": self.choice.getstate(),
            "pending": None if self.pending is None else dict(vars(self.pending)),
            "product_forms": orient.saved(),  # a resumed run samples with the same products
        }

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.choice.setstate(state["choice"])
        orient.restore(state.get("product_forms", []))  # none in checkpoints before them
        pending = state["pending"]
        self.pending = None if pending is None else Rollouts(**pending)
        if self.pending is not None:  # the teacher scores it again: the channels start empty
            self._pending_batches = self.batches(self.pending)
            self.submit(self._pending_batches)
