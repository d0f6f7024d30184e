"""The on-policy step: prompts -> the student samples -> each teacher scores -> the student learns.

One optimizer step of on-policy distillation on every rank (`OnPolicy.step`), chosen by the loop
instead of the off-policy `Trainer.train_step` with probability ``onpolicy.lmbda`` (GKD's
lambda; the draw comes from a seeded RNG that every rank holds alike and checkpoints):

1. **Generate**: ``prompts_per_step`` prompts of this rank (`trainer.onpolicy.prompts`), each
   sampled ``n_samples`` times by the student with its current weights
   (`trainer.onpolicy.sampler`), its FSDP2 parameters gathered once for the whole phase;
2. **Align**: the rollouts cut into microbatches (`trainer.onpolicy.rollouts`): the sampled ids
   for teachers with the student's tokenizer, on-the-fly alignment for the others;
3. **Score**: every microbatch submitted to every teacher's channel (`trainer.onpolicy.rollout_scoring`);
4. **Learn**: counts first (all-reduced over data-parallel ranks before the first backward),
   then per microbatch the student's forward, each teacher's term (``local sum / global
   count``), their weighted sum (or one term on the probability-space mixture of same-tokenizer
   teachers), backward (``loss.kd_weight`` and ``ce_weight`` weigh the off-policy steps only:
   an on-policy step's loss is its distillation term); the gradient norm, the same guard
   and optimizer step as `Trainer.train_step`. No CE: the student's likelihood of its own
   samples is not a target.

Policy lag (``onpolicy.lag``): 0 is exact on-policy, every rollout is learnt by the weights that
sampled it. 1 overlaps the teacher with the student: the rollouts of the next on-policy step are
sampled and submitted *before* the student learns on this step's, so the teacher scores them
while the student runs its forward and backward, and each update learns on rollouts sampled by
the weights one update older. The pending rollouts are part of the checkpoint, so a resumed run
learns on exactly what the uninterrupted one would.

Legend: B rollouts in a microbatch, T student positions, V student lm_head width.
"""

from __future__ import annotations

import pickle
import random
import time
import zlib
from collections import Counter

import torch

from tokenbridge.losses.opd import mix_teacher_outputs
from tokenbridge.teacher.outputs import TeacherOutputs
from trainer.onpolicy.agreement import completion_bpb
from trainer.onpolicy.prompts import ChatPrompts, TextPrompts
from trainer.onpolicy.rollout_scoring import open_scorers, receive_copy
from trainer.onpolicy.rollouts import RolloutBatch, build_batch
from trainer.onpolicy.sampler import Rollouts, SamplingConfig, gathered, sample
from trainer.onpolicy.teachers import build_teachers, teacher_max_len
from trainer.parallel import parallelize
from trainer.run_log import StepNumbers, peak_memory_gib


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
        )
        per_step = self.op.prompts_per_step * self.op.n_samples
        self.mb = self.op.micro_batch_size or per_step
        self.n_mb = per_step // self.mb
        self.choice = random.Random(f"{self.op.seed}/lmbda")  # the same draw on every rank
        self.pending: Rollouts | None = None  # lag 1: sampled and submitted, not learnt yet
        self._pending_batches: list | None = None
        self.mixture = self.op.mix == "mixture" and len(self.teachers.terms) > 1
        total = sum(self.teachers.weights)
        self.weights = [w / total for w in self.teachers.weights]
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
            threads=cfg.parallel.threads or None,
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

    def generate(self, prompts=None, *, salt: str = "") -> Rollouts:
        """Rollouts of this rank's next prompts (or of ``prompts``) with the current weights."""
        if prompts is None:
            prompts = self.prompts.next_prompts(self.op.prompts_per_step)
        model = self.tr.model
        was_training = model.training
        model.eval()
        try:
            with gathered(model, reshard_after_forward=self.cfg.parallel.reshard_after_forward):
                r = sample(
                    model,
                    [p.ids for p in prompts],
                    config=self.sampling,
                    seeds=self.seeds(prompts, salt),
                    stop_ids=self.teachers.stop_ids,
                    vocab_size=self.tr.vocab_used,
                    tp_group=self.tp_group,
                )
        finally:
            model.train(was_training)
        r.meta = [{"key": prompts[i].key, "messages": prompts[i].messages} for i in r.prompt_index]
        return r

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
        t0 = time.perf_counter()
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
        t2 = time.perf_counter()
        outs, teacher_s = self.receive(len(batches))
        times["teacher_wait_s"] += time.perf_counter() - t2
        if self.op.lag == 1 and not last:
            # the next step's rollouts, sampled by these weights before they learn on `r`:
            # the teachers score them while the student runs its forward and backward
            t3 = time.perf_counter()
            self.pending = self.generate()
            times["generate_s"] += time.perf_counter() - t3
            times["gen_tokens"] += self.pending.new_tokens
            t4 = time.perf_counter()
            self._pending_batches = self.batches(self.pending)
            times["align_s"] += time.perf_counter() - t4
            self._timed_submit(self._pending_batches, times)
        t5 = time.perf_counter()
        record = self.learn(r, batches, outs, log=log)
        times["student_s"] += time.perf_counter() - t5
        if record is None:
            return None
        gen_tokens = times.pop("gen_tokens", 0)
        record.update({f"time/{k}": v for k, v in times.items()})
        if times["generate_s"] > 0:  # this rank's sampler speed over what it sampled this step
            record["rollout/gen_tokens_per_s"] = gen_tokens / times["generate_s"]
        record.update(teacher_s=teacher_s, step_s=time.perf_counter() - t0, onpolicy=1.0)
        record["tokens_per_s"] = record["tokens"] / record["step_s"]
        return record

    def learn(self, r: Rollouts, batches, outs, *, log: bool) -> dict[str, float] | None:
        """Counts, forward + backward per microbatch, the guard and the optimizer step."""
        tr, terms = self.tr, self.teachers.terms
        n_terms = 1 if self.mixture else len(terms)
        dev = tr.device
        local = torch.zeros(n_terms + 1, dtype=torch.float64, device=dev)
        precounts = []
        for b, preps in batches:
            pre = [terms[j].count(preps[j]) for j in range(n_terms)]
            precounts.append(pre)
            for j in range(n_terms):
                local[j] += pre[j]
            local[-1] += b.attention_mask_BT.sum()
        counts = tr.mesh.sum_over_tokens_(local)
        parts = torch.zeros(2 * n_terms + 1, dtype=torch.float64, device=dev)
        for m, (b, preps) in enumerate(batches):
            tr.model.set_requires_gradient_sync(m == len(batches) - 1)
            # whole logits under TP (the on-policy losses are not vocab-parallel): every TP rank
            # computes the same loss, and the gather's backward keeps each rank's shard of it
            with parallelize.gathered_logits(tr.model):
                logits_BTV = tr.model(
                    input_ids=b.input_ids_BT, attention_mask=b.attention_mask_BT, use_cache=False
                ).logits
            if self.mixture:
                mixed = mix_teacher_outputs(outs[m], self.teachers.weights)
                kd = [terms[0].loss(logits_BTV, mixed, preps[0])]
                weights = [1.0]
            else:
                kd = [t.loss(logits_BTV, outs[m][j], preps[j]) for j, t in enumerate(terms)]
                weights = self.weights
            means = [o.mean(counts[j]) for j, o in enumerate(kd)]
            total = sum(w * v for w, v in zip(weights, means))
            total.backward()
            missed = [(o.count - c).abs().double() for o, c in zip(kd, precounts[m])]
            parts += torch.stack([*(v.detach().double() for v in means),
                                  total.detach().double(), *missed])  # fmt: skip
        parallelize.sync_replicated_grads(tr.model, tr.replicated_grads, tr.mesh.tp)
        grad_norm = parallelize.clip_grad_norm_(
            list(tr.model.parameters()), self.cfg.optim.grad_clip
        )
        stats = self._stats(r, batches)
        both = torch.cat([parts, stats.to(dev)])
        tr.mesh.sum_over_tokens_(both)
        host = torch.cat([both, counts, grad_norm.reshape(1).to(both)]).tolist()
        kd_means, total_v = host[:n_terms], host[n_terms]
        missed = host[n_terms + 1 : 2 * n_terms + 1]
        stat_v = host[2 * n_terms + 1 : 2 * n_terms + 1 + stats.numel()]
        count_v, norm = host[-(n_terms + 2) : -1], host[-1]
        names = ["mixture"] if self.mixture else [t.name for t in terms]
        if any(missed):
            raise RuntimeError(f"on-policy terms {names} counted other terms than their pre-counts")
        nums = StepNumbers([0.0, *kd_means, total_v], missed, [0.0, *count_v], norm, {})
        lr = tr.scheduler.get_last_lr()[0]
        tr._apply_or_guard(nums, terms=names)
        tr.step += 1
        tr.tokens_seen += int(count_v[-1])
        if not log:
            return None
        m = {"loss": total_v, "kd": total_v, "grad_norm": norm, "lr": lr}
        for name, v, c in zip(names, kd_means, count_v):
            m[f"kd/{name}"] = v
            m[f"coverage/{name}"] = c / max(1.0, stat_v[1])  # terms per sampled token
        m.update(self._stat_record(stat_v))
        m.update(tokens=int(count_v[-1]), memory_gib=peak_memory_gib(dev), epoch=tr.loader.epoch)
        return m

    def _stat_names(self) -> list[str]:
        names = ["rollouts", "new_tokens", "stopped"]
        for t in self.teachers.terms:
            names += [f"dropped/{t.name}", f"chunks_boundary/{t.name}", f"chunks_invalid/{t.name}"]
        return names

    def _stats(self, r: Rollouts, batches) -> torch.Tensor:
        vals = [len(r), r.new_tokens, sum(r.stopped)]
        for j in range(len(self.teachers.terms)):
            vals += [
                sum(sum(b.drops[j].values()) for b, _ in batches),
                sum(b.chunk_drops[j]["boundary"] for b, _ in batches),
                sum(b.chunk_drops[j]["invalid_utf8"] for b, _ in batches),
            ]
        return torch.tensor(vals, dtype=torch.float64)

    def _stat_record(self, vals: list[float]) -> dict[str, float]:
        m = dict(zip(self._stat_names(), vals))
        n = max(1.0, m["rollouts"])
        m["rollout/len_mean"] = m.pop("new_tokens") / n
        m["rollout/stopped_frac"] = m.pop("stopped") / n
        m["rollout/count"] = m.pop("rollouts")
        return m

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
        r = self.generate(prompts, salt="eval/")
        batches = self.batches(r)
        outs = self.score_all(batches)
        names = [t.name for t in self.teachers.terms]
        return completion_bpb(batches, outs, names, student=self.tr.prep.student_tok)

    def state_dict(self) -> bytes:
        """This rank's on-policy position: prompts, the lambda RNG, pending rollouts (sampling
        needs no state: each rollout's seed is derived from what it is)."""
        return pickle.dumps(
            {
                "prompts": self.prompts.state_dict(),
                "choice": self.choice.getstate(),
                "pending": self.pending,
            }
        )

    def load_state_dict(self, blob: bytes) -> None:
        state = pickle.loads(blob)
        self.prompts.load_state_dict(state["prompts"])
        self.choice.setstate(state["choice"])
        self.pending = state["pending"]
        if self.pending is not None:  # the teacher scores it again: the channels start empty
            self._pending_batches = self.batches(self.pending)
            self.submit(self._pending_batches)
