"""Rollouts as a source of microbatches: prompts -> the student samples -> each teacher scores.

An on-policy step (`OnPolicy.step`) is the one training step (`trainer.step.TrainStep`) run on
the student's own rollouts instead of shard batches; the loop takes one with probability
``onpolicy.lmbda`` (GKD's lambda; the draw comes from a seeded RNG that every rank holds alike
and checkpoints). This module holds what is the on-policy side's own:

1. **Generate**: ``prompts_per_step`` prompts of this rank (`trainer.onpolicy.prompts`), each
   sampled ``n_samples`` times by the student with its current weights
   (`trainer.onpolicy.sampler`), its FSDP2 parameters gathered once for the whole phase;
2. **Align**: the rollouts cut into microbatches (`trainer.onpolicy.rollouts`): the sampled ids
   for teachers with the student's tokenizer, on-the-fly alignment for the others;
3. **Score**: every microbatch submitted to every teacher's channel (`trainer.onpolicy.rollout_scoring`);
4. **Learn**: the rollouts' microbatches handed to the one step as a `RolloutSource`: their
   counts, the student's forward on whole rows (whole logits under TP), each teacher's term,
   their weighted sum (or one term on the probability-space mixture of same-tokenizer
   teachers). ``loss.kd_weight`` and ``ce_weight`` weigh the off-policy steps only: an
   on-policy step's loss is its distillation term. No CE: the student's likelihood of its own
   samples is not a target.

Policy lag (``onpolicy.lag``): 0 is exact on-policy, every rollout is learnt by the weights that
sampled it. 1 overlaps the teacher with the student: the rollouts of the next on-policy step are
sampled *before* the student learns on this step's, while the teachers score this step's, and
submitted after the update; each update learns on rollouts sampled by the weights one update
older. The overlap is the sampling rather than the update because on CPU the two processes
then share the cores (`trainer.parallel.cpus`), and sampling gains least from more threads;
the sampler polls the teachers before each decode step (`TeacherChannel.done`, never waiting)
and takes every core back as soon as they have finished, so the overlap lasts as long as the
scoring and no longer (``time/overlap_s``). The
pending rollouts are part of the checkpoint, so a resumed run learns on exactly what the
uninterrupted one would.

Legend: B rollouts in a microbatch, T student positions, V student lm_head width.
"""

from __future__ import annotations

import contextlib
import random
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from tokenbridge.losses.multi_teacher import combine_teachers
from tokenbridge.losses.opd import mix_teacher_outputs
from tokenbridge.teacher.outputs import TeacherOutputs
from trainer.loss_terms import kd_weights
from trainer.onpolicy import orient
from trainer.onpolicy.agreement import completion_bpb
from trainer.onpolicy.decode import int8_weights
from trainer.onpolicy.importance import RATIO_STATS, policy_logprobs, prefix_weights, scale_grad
from trainer.onpolicy.prompts import ChatPrompts, TextPrompts
from trainer.onpolicy.rollout_scoring import open_scorers, receive_copy
from trainer.onpolicy.rollouts import RolloutBatch, build_batch, completion_rows
from trainer.onpolicy.sampler import Rollouts, SamplingConfig, gathered, sample
from trainer.onpolicy.teachers import build_teachers, teacher_max_len
from trainer.parallel import parallelize
from trainer.parallel.cpus import torch_threads
from trainer.parallel.head import head_logits
from trainer.run_log import StepNumbers, peak_memory_gib
from trainer.step import Source, Terms


def used_inputs(record, prep, aligned, inputs: dict) -> dict:
    """A teacher's inputs with ``used_mask`` [B, U]: the positions that predict a completion
    token (every on-policy loss and the agreement eval read those only: the prompt is never a
    target and carries no chunk), with the rows the mode itself names where it names them.
    The teacher's lm_head (262k columns for Gemma) and its reductions skip the prompt
    (`teacher_forward`)."""
    width = inputs["input_ids"].shape[1]
    used = completion_rows(aligned, width)
    if record.teacher_rows is not None:
        used |= record.teacher_rows(prep, width).bool()
    return {**inputs, "used_mask": used & (inputs["attention_mask"] > 0)}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class OnPolicy:
    """The on-policy side of one `Trainer` (built in its ``_build``; see the module docstring)."""

    def __init__(self, trainer):
        self.tr = trainer
        cfg, prep = trainer.cfg, trainer.prep
        self.cfg, self.op = cfg, cfg.onpolicy
        mesh = trainer.mesh
        student = prep.student_tok
        common = {"dp_rank": mesh.dp_rank, "dp_size": mesh.dp_size, "seed": self.op.seed}
        if self.op.prompts == "text":
            self.prompts = TextPrompts(
                trainer.loader.stream.reader,
                shuffle_buffer=cfg.data.shuffle_buffer,
                eval_fraction=cfg.data.eval_fraction,
                eval_split=cfg.data.eval_split,
                val_fraction=cfg.data.val_fraction,
                eval_on=cfg.data.eval_on,
                prompt_tokens=self.op.prompt_tokens,
                **common,
            )
            prompt_max, chat = self.op.prompt_tokens, None
        else:
            self.prompts = ChatPrompts(
                self.op.chat_data,
                student,
                model_dir=cfg.model.path,
                template=self.op.chat_template or None,
                eval_fraction=cfg.data.eval_fraction,
                max_tokens=cfg.data.max_student_tokens,
                val_fraction=cfg.data.val_fraction,
                eval_on=cfg.data.eval_on,
                **common,
            )
            prompt_max, chat = cfg.data.max_student_tokens, self.prompts.side
        self.max_len = _round_up(prompt_max + self.op.max_new_tokens, cfg.data.pad_to_multiple)
        self.teachers = build_teachers(
            cfg,
            student=student,
            teachers=prep.teacher_toks,
            student_chat=chat,
            max_len=self.max_len,
        )
        self.sampling = SamplingConfig(
            temperature=self.op.temperature,
            top_p=self.op.top_p,
            max_new_tokens=self.op.max_new_tokens,
            n_samples=self.op.n_samples,
            record_topk=self.teachers.topk,
            weights=self.op.sampler_weights,
        )
        per_step = self.op.prompts_per_step * self.op.n_samples
        self.mb = self.op.micro_batch_size or per_step
        self.n_mb = per_step // self.mb
        self.choice = random.Random(f"{self.op.seed}/lmbda")  # the same draw on every rank
        self.pending: Rollouts | None = None  # lag 1: sampled and submitted, not learnt yet
        # int8 sampling: the copy and the rollout phases it has served (not checkpointed: a
        # resumed run makes a new one, so with sampler_refresh > 1 its rollouts may differ)
        self.int8, self.int8_uses, self.int8_copy_s = None, 0, 0.0  # seconds making copies
        self.overlap_s = 0.0  # lag 1: seconds the last rollout phase sampled beside the teachers
        self._pending_batches: list | None = None
        self.mixture = self.op.mix == "mixture" and len(self.teachers.terms) > 1
        # the step's KD terms: the teachers' own, or one on their mixture (weighted inside)
        terms = self.teachers.terms
        weights = torch.ones(1, dtype=torch.float64) if self.mixture else kd_weights(terms)
        self.kd_weights = weights.to(trainer.device)  # on the device once, as `ShardSource`'s
        self.tp_group = mesh.tp if mesh.tp_size > 1 else None
        self.channels = open_scorers(
            [cfg.teachers[t.index] for t in self.teachers.terms],
            [t.spec for t in self.teachers.terms],
            device=trainer.device,
            max_batch=self.mb,
            max_len=teacher_max_len(self.teachers.views, self.max_len),
            depth=self.n_mb,
            inprocess=cfg.parallel.teacher_placement == "inprocess",
            timeout_s=cfg.parallel.teacher_timeout_s,
            threads=trainer.cpus.worker,
            dtypes=[trainer.prep.precision.teacher_dtypes[t.index] for t in self.teachers.terms],
        )

    def close(self) -> None:
        for ch in self.channels:
            ch.close()

    # -------------------------------------------------------------------------------------
    # the phases

    def takes_step(self) -> bool:
        """Is the next step on-policy? (One draw per step, alike on every rank.)"""
        return self.choice.random() < self.op.lmbda

    def seeds(self, prompts, salt: str = "") -> list[int]:
        """One sampling seed per rollout, from what it is (run seed, prompt, its draw, sample
        index): the same completion in any layout, batch or resumed run (`sampler`)."""
        return [
            zlib.crc32(f"{self.op.seed}/{salt}{p.key}/{p.draw}/{s}".encode())
            for p in prompts
            for s in range(self.op.n_samples)
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
            prompts = self.prompts.next_prompts(self.op.prompts_per_step)
        model = self.tr.model
        was_training = model.training
        model.eval()
        on_step, cores = None, torch.get_num_threads()
        if release is not None and threads is not None:
            on_step = _Release(release, threads=cores)
        try:
            with (
                torch_threads(threads),
                gathered(model, reshard_after_forward=self.cfg.parallel.reshard_after_forward),
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
                    vocab_size=self.tr.vocab_used,
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
        if self.int8 is None or self.int8_uses >= self.op.sampler_refresh:
            t0 = time.perf_counter()
            self.int8 = None  # the old copy freed first: never two at once
            self.int8 = int8_weights(model, vocab_size=self.tr.vocab_used, threads=threads)
            self.int8_uses = 0
            self.int8_copy_s += time.perf_counter() - t0
        self.int8_uses += 1
        return self.int8

    def batches(self, r: Rollouts) -> list[tuple[RolloutBatch, list]]:
        """The rollouts' microbatches and each term's preparation (its mask or chunk index)."""
        out = []
        for m in range(-(-len(r) // self.mb)):
            rows = list(range(m * self.mb, min(len(r), (m + 1) * self.mb)))
            b = build_batch(
                r,
                rows,
                student=self.tr.prep.student_tok,
                teachers=self.teachers.views,
                want_cols=[t.spec.per_position_columns for t in self.teachers.terms],
                pad_id=self.tr.loader.student_pad,
                pad_to_multiple=self.cfg.data.pad_to_multiple,
            ).to(self.tr.device)
            preps = [
                t.record.prepare(b.aligned[j], b.targets_BT)
                for j, t in enumerate(self.teachers.terms)
            ]
            for j, t in enumerate(self.teachers.terms):
                inputs = b.teacher_inputs[j]
                b.teacher_inputs[j] = used_inputs(t.record, preps[j], b.aligned[j], inputs)
            out.append((b, preps))
        return out

    def submit(self, batches: list[tuple[RolloutBatch, list]]) -> None:
        for b, _ in batches:
            for ch, inputs in zip(self.channels, b.teacher_inputs):
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

    def _timed_submit(self, batches, times: Counter) -> None:
        # in-process teachers compute inside submit: their time is the teacher's, not align's
        t0 = time.perf_counter()
        self.submit(batches)
        times["submit_s"] += time.perf_counter() - t0

    def _scored(self) -> bool:
        """Have the teachers finished every microbatch submitted to them (never waits)?"""
        return all(ch.done() for ch in self.channels)

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
        """One on-policy optimizer step (see the module docstring); its record on a logging
        step. ``last``: no later on-policy step will run in this process (lag 1 samples none)."""
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
        if self.op.lag == 1 and not last:
            # the next step's rollouts, sampled by these weights before they learn on `r`,
            # while the teachers score `r`; on CPU with the threads the workers leave free
            # (`trainer.parallel.cpus`) until they have finished, then on every core, and the
            # update below runs alone on every core
            t3 = time.perf_counter()
            nxt = self.generate(threads=self.tr.cpus.overlap, release=self._scored)
            times["generate_s"] += time.perf_counter() - t3
            times["overlap_s"] += self.overlap_s
            times["gen_tokens"] += nxt.new_tokens
            t4 = time.perf_counter()
            nxt_batches = self.batches(nxt)
            times["align_s"] += time.perf_counter() - t4
        t2 = time.perf_counter()
        outs, teacher_s = self.receive(len(batches))
        times["teacher_wait_s"] += time.perf_counter() - t2
        t5 = time.perf_counter()
        record = self.tr.stepper.run(RolloutSource(self, r, batches, outs), log=log)
        times["student_s"] += time.perf_counter() - t5
        if nxt is not None:  # scored while the student samples the step after this one
            self._timed_submit(nxt_batches, times)
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
        record |= self.tr.throughput.record(
            tokens=record["tokens"], step_s=record["step_s"], seq=None
        )
        return record

    # -------------------------------------------------------------------------------------
    # eval and state

    def evaluate(self) -> dict[str, float]:
        """The teachers' bits per byte of the student's own completions of the held-out prompts
        (sampled with a fixed seed, the same on every rank and every call)."""
        if not self.op.eval_prompts:
            return {}
        prompts = self.prompts.held_out(self.op.eval_prompts)
        if not prompts:
            return {}
        r = self.generate(prompts, salt="eval/", exact=True)
        batches = self.batches(r)
        outs = self.score_all(batches)
        names = [t.name for t in self.teachers.terms]
        return completion_bpb(batches, outs, names, student=self.tr.prep.student_tok)

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


class _Release:
    """A sampler's ``on_step``: once ``release()`` is true, torch's ``threads`` again (those it
    had before `torch_threads` lowered them: the work beside the sampler is over)."""

    def __init__(self, release: Callable[[], bool], *, threads: int):
        self.release, self.threads = release, threads
        self.t0, self.held_s = time.perf_counter(), None

    def __call__(self) -> None:
        if self.held_s is None and self.release():
            torch.set_num_threads(self.threads)
            self.held_s = time.perf_counter() - self.t0

    def held(self) -> float:
        """Seconds the lowered thread count was held (all along if never released)."""
        return time.perf_counter() - self.t0 if self.held_s is None else self.held_s


class RolloutSource(Source):
    """One on-policy step's rollouts as the one step's microbatches (`trainer.step.Source`):
    their counts, the student's forward, each teacher's term on its outputs, their weighted sum
    (see the module docstring). ``batches``: `OnPolicy.batches` of ``r``; ``outs``: the
    teachers' outputs per microbatch."""

    def __init__(self, op: OnPolicy, r: Rollouts, batches, outs):
        self.op, self.r, self.batches, self.outs = op, r, batches, outs
        terms = op.teachers.terms
        self.terms = terms[:1] if op.mixture else terms  # the mixture: one term, the first's mode
        self.kd_names = ["mixture"] if op.mixture else [t.name for t in terms]
        self.kd_modes = [t.mode for t in self.terms]
        # the ratio weights' sums over this step's microbatches (int8 sampling only)
        self.ratio = Counter()

    def __len__(self) -> int:
        return len(self.batches)

    def start(self) -> tuple[torch.Tensor, list[list[int]]]:
        n = len(self.terms)
        local = torch.zeros(n + 2, dtype=torch.float64, device=self.op.tr.device)  # no CE: 0
        precounts = []
        for b, preps in self.batches:
            pre = [t.count(preps[j]) for j, t in enumerate(self.terms)]
            precounts.append(pre)
            for j in range(n):
                local[1 + j] += pre[j]
            local[-1] += b.attention_mask_BT.sum()
        return local, precounts

    @contextlib.contextmanager
    def microbatch(self, i: int) -> Iterator[Terms]:
        b, preps = self.batches[i]
        model = self.op.tr.model
        # whole vocabulary under TP (the on-policy losses are not vocab-parallel): every TP
        # rank computes the same loss, and the gather's backward keeps each rank's shard of it.
        # With parallel.logits_chunk, the logits are projected block by block, never whole.
        chunk = self.op.tr.cfg.parallel.logits_chunk
        kw = {"input_ids": b.input_ids_BT, "attention_mask": b.attention_mask_BT}
        if chunk:
            with head_logits(model, chunk=chunk, gather_vocab=True) as head:
                model(**kw, use_cache=False)
            logits_BTV = head.logits
        else:
            with parallelize.gathered_logits(model):
                logits_BTV = model(**kw, use_cache=False).logits
        if b.behaviour_BT is not None:
            logits_BTV = self._weigh(logits_BTV, b)
        if self.op.mixture:
            raw = [t.weight for t in self.op.teachers.terms]
            mixed = mix_teacher_outputs(self.outs[i], raw)
            kd = [self.terms[0].loss(logits_BTV, mixed, preps[0])]
        else:
            kd = [t.loss(logits_BTV, self.outs[i][j], preps[j]) for j, t in enumerate(self.terms)]
        yield Terms(None, kd)

    def _weigh(self, logits_BTV, b):
        """The logits with each position's gradient weighted by its state's likelihood ratio
        (`importance`)."""
        op = self.op
        target = policy_logprobs(
            logits_BTV, b.targets_BT, config=op.sampling, vocab=op.tr.vocab_used
        )
        w_BT, stats = prefix_weights(target, b.behaviour_BT, b.targets_BT, clip=op.op.ratio_clip)
        n = int((b.targets_BT >= 0).sum())
        for k, v in stats.items():
            self.ratio[k] += v * n
        self.ratio["n"] += n
        return scale_grad(logits_BTV, w_BT)

    def combine(self, ce: torch.Tensor | None, kd: list[torch.Tensor]) -> torch.Tensor:
        return combine_teachers(kd, self.op.kd_weights)[0]

    def rows(self) -> list:
        return [m["key"] for m in self.r.meta]

    def _stat_names(self) -> list[str]:
        names = ["rollouts", "new_tokens", "stopped"]
        for t in self.op.teachers.terms:
            names += [f"dropped/{t.name}", f"chunks_boundary/{t.name}", f"chunks_invalid/{t.name}"]
        if self.op.sampling.records_logprobs:
            names += [*RATIO_STATS, "ratio/n"]
        return names

    def step_sums(self) -> dict[str, float]:
        r, batches = self.r, self.batches
        vals = [len(r), r.new_tokens, sum(r.stopped)]
        for j in range(len(self.op.teachers.terms)):
            vals += [
                sum(sum(b.drops[j].values()) for b, _ in batches),
                sum(b.chunk_drops[j]["boundary"] for b, _ in batches),
                sum(b.chunk_drops[j]["invalid_utf8"] for b, _ in batches),
            ]
        if self.op.sampling.records_logprobs:
            vals += [self.ratio[k] for k in RATIO_STATS] + [self.ratio["n"]]
        return dict(zip(self._stat_names(), vals))

    def record(self, nums: StepNumbers, *, lr: float, step_s: float) -> dict[str, float]:
        """The on-policy record (`OnPolicy.step` adds its timings and ``step_s``)."""
        total, stats, counts = nums.losses[-1], dict(nums.source_sums), nums.counts[1:]
        m = {"loss": total, "kd": total, "grad_norm": nums.grad_norm, "lr": lr}
        for name, v, c in zip(self.kd_names, nums.losses[1:-1], counts):
            m[f"kd/{name}"] = v
            m[f"coverage/{name}"] = c / max(1.0, stats["new_tokens"])  # terms per sampled token
        n = max(1.0, stats["rollouts"])
        m.update(stats)
        m["rollout/len_mean"] = m.pop("new_tokens") / n
        m["rollout/stopped_frac"] = m.pop("stopped") / n
        m["rollout/count"] = m.pop("rollouts")
        if "ratio/n" in m:  # sums over positions (and ranks) -> means
            n = max(1.0, m.pop("ratio/n"))
            m.update({k: m[k] / n for k in RATIO_STATS})
        tr = self.op.tr
        m.update(
            tokens=int(counts[-1]), memory_gib=peak_memory_gib(tr.device), epoch=tr.loader.epoch
        )
        return m
