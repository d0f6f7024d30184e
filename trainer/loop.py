"""The training loop: the verbs forward_backward_step, train_step, train, state_dict, load_state_dict.

Build order (`Trainer.__init__`): process group and (dp_shard, cp, tp) mesh -> data -> student
(TP plan, CP attention, then FSDP2) -> optimizer and LR schedule -> teacher channels (a worker
process per rank, or in-process, or an offline cache read in place of the teacher) -> resume.
Every file and fingerprint check ran before, in `trainer.config.preflight`.

The loss invariant, where it holds: each term is a local SUM divided by the GLOBAL count of its
step (summed over the step's microbatches and all-reduced over the data- and context-parallel
ranks, never over tensor-parallel ones, which hold the same terms), known before the first
backward of the step because counts depend on the batch only. FSDP sums (does not average)
gradients over dp x cp, so the result is the gradient of the global mean, for any microbatch
split and any dp, cp or tp size.

Layouts (`forward`): every rank of a dp group reads the same microbatch, whole; its student
forward sees this CP rank's positions of every row (load-balanced layout, global position ids)
and returns this TP rank's vocabulary shard of the logits, [B, T / cp, V / tp]. The losses take
that local block with the TP group and a `CPContext`; the teachers ran the whole rows.

The teacher runs ahead: microbatches are drawn from the data stream into a small queue and
submitted to the teacher channels as soon as a slot is free, so the teacher's forward on the
next microbatch overlaps the student's step on this one. A checkpoint records the data position
before the first queued-but-unused microbatch.

Legend: B rows, T student positions, L = T / cp of them on this rank, V student vocabulary
(lm_head width; V / tp of it on this rank).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from tokenbridge import models
from tokenbridge.dist_ops import CPContext
from tokenbridge.dist_ops.collectives import all_reduce_, group_size
from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded
from tokenbridge.formats import checksums as integrity
from tokenbridge.teacher.outputs import TeacherOutputs
from trainer import checkpoint as ckpt
from trainer import optim, report
from trainer.config.preflight import Prepared
from trainer.config.schema import TrainConfig
from trainer.eval import evaluate_bpb, trained_bpb
from trainer.loss_terms import KDTerm, build_kd_terms, ce_term, combine_terms, teacher_weights
from trainer.microbatches import (
    IGNORE,
    Microbatch,
    MicrobatchLoader,
    ShardReader,
    ShardStream,
    pad_id,
)
from trainer.onpolicy.step import OnPolicy
from trainer.parallel import parallelize
from trainer.parallel.cp_attention import model_inputs
from trainer.parallel.mesh import build_mesh
from trainer.run_log import (
    MetricsLogger,
    NonFiniteError,
    StepNumbers,
    format_summary,
    nonfinite_message,
    nonfinite_terms,
    peak_memory_gib,
    read_bpb,
    read_step,
    train_metrics,
    weighted_kd,
    write_bpb,
)
from trainer.teacher.dispatch import Feed, Queued, open_teachers
from trainer.teacher.ring import shm_mappings


def shm_usage() -> dict[str, float]:
    """The shared-memory segments this process maps (teacher channel rings; their names are
    unlinked once the worker maps them, so /dev/shm does not list them): count and bytes.
    Constant over a run when slots are reused, never re-allocated."""
    maps = shm_mappings()
    return {"shm_segments": len(maps), "shm_bytes": sum(maps.values())}


class Trainer:
    """One run of `cfg` on this rank. Use: ``t = Trainer(cfg, prepared); try: t.train()
    finally: t.close()``."""

    def __init__(self, cfg: TrainConfig, prepared: Prepared):
        self.cfg = cfg
        self.prep = prepared
        self.device = parallelize.pick_device(cfg.device)
        self.rank, self.world = parallelize.init_distributed(self.device)
        if cfg.parallel.threads:
            torch.set_num_threads(cfg.parallel.threads)
        dp, cp, tp = cfg.parallel.mesh_shape(self.world)
        self.mesh = build_mesh(self.device, dp=dp, cp=cp, tp=tp)
        self.run_dir = Path(cfg.run_dir)
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # non-finite steps skipped (optim.skip_nonfinite)
        self._closers: list[Any] = []
        try:
            self._build(cfg, prepared)
        except BaseException:
            self.close()  # teacher workers and shared memory must not outlive a failed build
            raise

    def _build(self, cfg: TrainConfig, prepared: Prepared) -> None:
        # data: this dp rank's share of the shards
        reader = ShardReader(prepared.shards, max_student_tokens=cfg.data.max_student_tokens)
        stream = ShardStream(
            reader,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp_size,
            seed=cfg.data.seed,
            shuffle_buffer=cfg.data.shuffle_buffer,
            eval_fraction=cfg.data.eval_fraction,
            eval_split=cfg.data.eval_split,
        )
        self.loader = MicrobatchLoader(
            stream,
            micro_batch_size=cfg.data.micro_batch_size,
            student_pad=pad_id(prepared.student_tok),
            teacher_pads=[pad_id(t) for t in prepared.teacher_toks],
            pad_to_multiple=cfg.data.pad_to_multiple,
        )
        self.eval_texts = self.loader.eval_texts(cfg.eval.max_texts)
        # conversation shards: bits per byte of the trained contents (`trained_bpb`)
        self.eval_rows = self.loader.eval_rows(cfg.eval.max_texts) if reader.is_chat else []
        mult = cfg.data.pad_to_multiple
        teacher_max = [-(-n // mult) * mult for n in prepared.teacher_max_len]

        # student: TP plan, CP attention, then FSDP2
        self.model = models.build_model(cfg.model, device=self.device)
        self.vocab_V = models.vocab_width(self.model)
        self.vocab_used = prepared.student_tok.vocab_size
        self.model.train()
        tp = self.mesh.tp_size
        plan = parallelize.tp_plan(self.model.config.model_type) if tp > 1 else {}
        self.replicated_grads = parallelize.apply_tp(self.model, self.mesh.tp_mesh, plan)
        parallelize.apply_cp(self.model, self.mesh.cp_size)
        mp = MixedPrecisionPolicy(
            param_dtype=models.torch_dtype(cfg.parallel.param_dtype),
            reduce_dtype=models.torch_dtype(cfg.parallel.reduce_dtype),
        )
        parallelize.apply_fsdp(
            self.model,
            self.mesh.fsdp_mesh,
            mp_policy=mp,
            reshard_after_forward=cfg.parallel.reshard_after_forward,
        )
        self.optimizer = optim.build_optimizer(self.model, cfg.optim)
        self.scheduler = optim.build_scheduler(self.optimizer, cfg.optim, steps=cfg.steps)

        # teachers and loss terms
        self.kd_terms: list[KDTerm] = build_kd_terms(cfg, prepared, device=self.device)
        weights = teacher_weights(cfg, self.kd_terms) if self.kd_terms else None
        self._kd_weight_list = weights.tolist() if weights is not None else []
        # on the device once: a host tensor would be copied over (a sync) every microbatch
        self.kd_weights = weights.to(self.device) if weights is not None else None
        self._kd_scale: float | None = None  # dynamic combine: last step's |CE| / |KD|
        self.channels = open_teachers(
            cfg,
            self.kd_terms,
            device=self.device,
            rank=self.rank,
            world=self.world,
            max_len=teacher_max,
            threads=cfg.parallel.threads or None,
            caches=prepared.caches,
            batch_group=self.mesh.batch,
        )
        self._closers += self.channels
        self.feed = Feed(self.loader, self.kd_terms, self.channels, device=self.device)
        # on-policy distillation (trainer.onpolicy): its prompts, sampler and teacher channels
        self.onpolicy = OnPolicy(self) if cfg.onpolicy.enabled else None
        if self.onpolicy is not None:
            self._closers.append(self.onpolicy)

        self.checkpointer = ckpt.Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint, rank=self.rank
        )
        self.resumed_from = prepared.resume  # verified by preflight (checkpoint.find_resume)
        if self.resumed_from is not None:
            self.load_state_dict_from(self.resumed_from)
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=self.is_main,
            jsonl=cfg.logging.jsonl,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            total_steps=cfg.stop_after or cfg.steps,
            start_step=self.step,
            fresh=self.resumed_from is None,
        )
        self._closers.append(self.metrics)

    # ---------------------------------------------------------------------------------------
    # state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs (DCP-ready: Stateful model+optim, per-rank blobs)."""
        position = self.feed.position()
        mine = {"data": position["position"], "rng": ckpt.rng_state()}
        if self.onpolicy is not None:
            mine["onpolicy"] = self.onpolicy.state_dict()
        return {
            "app": ckpt.ModelOptimState(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            f"rank{self.rank}": mine,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a loaded state (the model and optimizer were filled in place by DCP)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        mine = state[f"rank{self.rank}"]
        self.feed.reset()
        self.loader.load_state_dict({"position": mine["data"]})
        ckpt.set_rng_state(mine["rng"])
        if self.onpolicy is not None:
            self.onpolicy.load_state_dict(mine["onpolicy"])

    def load_state_dict_from(self, path: Path) -> None:
        state = self.state_dict()
        self.checkpointer.load(path, state)
        self.load_state_dict(state)

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.state_dict())

    # ---------------------------------------------------------------------------------------
    # the verbs

    def cp_context(self, mb: Microbatch) -> CPContext | None:
        """What the losses need to know of this rank's CP share of `mb` (None at cp = 1)."""
        if self.mesh.cp_size == 1:
            return None
        return CPContext(self.mesh.cp, mb.input_ids_BT.shape[1])

    def forward(self, mb: Microbatch) -> torch.Tensor:
        """The student's logits on this rank, [B, L, V / tp]: its CP positions of every row
        (global position ids) and its TP shard of the vocabulary. Under TP the lm_head returns
        a DTensor sharded on the vocabulary; only its local shard leaves here (the unwrap
        checks the placement), so full-vocabulary logits never exist on one rank."""
        rows = mb.student_rows(cp_size=self.mesh.cp_size, cp_rank=self.mesh.cp_rank)
        kw = model_inputs(rows, group=self.mesh.cp)
        logits_BLV, _ = unwrap_vocab_sharded(self.model(**kw, use_cache=False).logits)
        return logits_BLV

    def forward_backward_step(
        self,
        q: Queued,
        teacher_outputs: list[TeacherOutputs],
        *,
        counts: torch.Tensor,
        precounts: list[int],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of one microbatch, with no host sync. Returns, detached,
        ``[ce, kd_0.., total, missed_0..]`` (each term's share of the step loss: local sum /
        global count; each KD term's |count - pre-count|) and the losses' own metric sums."""
        mb = q.mb
        logits_BLV = self.forward(mb)
        par = {"tp_group": self.mesh.tp, "cp": self.cp_context(mb)}
        if self.kd_terms and self.cfg.loss.ce_weight == 0:
            with torch.no_grad():  # CE is always reported, but needs no graph here
                ce_out = ce_term(logits_BLV.detach(), mb, vocab_size=self.vocab_used, **par)
        else:
            ce_out = ce_term(logits_BLV, mb, vocab_size=self.vocab_used, **par)
        kd_outs = [
            term.loss(logits_BLV, outs, q.prep[i], **par)
            for i, (term, outs) in enumerate(zip(self.kd_terms, teacher_outputs))
        ]
        total, parts = combine_terms(
            self.cfg.loss,
            ce_out,
            kd_outs,
            counts=counts,
            weights=self.kd_weights,
            scale=self._kd_scale,
        )
        total.backward()
        # the step was divided by the pre-counts, so a loss that counts otherwise would be
        # scaled wrongly; kept on the device and checked once per step (`_check_counts`):
        # `int(out.count)` here would wait for the device on every microbatch
        missed = [(o.count - c).abs().double() for o, c in zip(kd_outs, precounts)]
        sums = {
            f"{term.name}/{k}": v
            for term, out in zip(self.kd_terms, kd_outs)
            for k, v in out.metrics.items()
            if k.endswith("_sum")  # the ones logged (as means per KD term)
        }
        return torch.stack([*parts, total.detach(), *missed]).double(), sums

    def _step_counts(self, step: list[Queued]) -> tuple[torch.Tensor, list[list[int]]]:
        """This rank's [ce, kd_0.., tokens] over the step (on the device, not read back) and
        each microbatch's KD pre-counts (`KDTerm.count`: host ints). Under CP each rank counts
        the positions and chunk terms it computes, so the sum over dp and cp is the global
        count; TP ranks count alike and are never summed."""
        cps = [self.cp_context(q.mb) for q in step]
        pre = [[t.count(p, cp) for t, p in zip(self.kd_terms, q.prep)] for q, cp in zip(step, cps)]
        local = torch.zeros(2 + len(self.kd_terms), dtype=torch.float64, device=self.device)

        def mine(x_BT: torch.Tensor, cp: CPContext | None) -> torch.Tensor:
            return x_BT if cp is None else cp.shard(x_BT)

        local[0] = sum((mine(q.mb.targets_BT, cp) != IGNORE).sum() for q, cp in zip(step, cps))
        for j in range(len(self.kd_terms)):
            # a scalar fill: copying a host tensor over would wait for the device
            local[1 + j] = sum(row[j] for row in pre)
        local[-1] = sum(mine(q.mb.attention_mask_BT, cp).sum() for q, cp in zip(step, cps))
        return local, pre

    def _loss_sum_names(self, sums: dict[str, torch.Tensor]) -> list[str]:
        """The names of the losses' metric sums on any dp or cp rank, in one order (they may
        differ: xtoken has a chain sum only where multi-token chunks occurred); swapped as host
        objects on logging steps only, then reduced with the losses in one tensor all-reduce."""
        n = group_size(self.mesh.dp_cp)
        if not self.kd_terms or n == 1:
            return sorted(sums)
        every: list[list[str]] = [[] for _ in range(n)]
        dist.all_gather_object(every, sorted(sums), group=self.mesh.dp_cp)
        return sorted(set().union(*every))

    def train_step(self, *, log: bool = True) -> dict[str, float] | None:
        """One optimizer step over `grad_accum` microbatches on every dp rank; its metrics on a
        logging step, else None. The step's numbers stay on the device until ONE read, after
        the gradient norm and before the optimizer step: the non-finite guard needs the losses
        and the norm there, and the norm is computed for clipping anyway. Other host-side
        work (metric names swapped between ranks, the shared-memory count, the record) waits for a
        logging step."""
        t0 = time.perf_counter()
        n_mb, n_terms = self.cfg.data.grad_accum, len(self.kd_terms)
        step = self.feed.peek(n_mb)
        # every term's global count, known before the first backward: [ce, kd_0.., tokens]
        local, precounts = self._step_counts(step)
        counts = self.mesh.sum_over_tokens_(local)  # over dp and cp, never tp
        shares = torch.zeros(2 + 2 * n_terms, dtype=torch.float64, device=self.device)
        sums: dict[str, torch.Tensor] = {}
        teacher_s = 0.0
        for i in range(n_mb):
            # reduce-scatter the gradients once per step, after the last microbatch
            self.model.set_requires_gradient_sync(i == n_mb - 1)
            q, received = self.feed.next()
            try:
                outs = [TeacherOutputs(**r.outputs) for r in received]
                teacher_s += sum(r.teacher_s for r in received)
                part, more = self.forward_backward_step(
                    q, outs, counts=counts[:-1], precounts=precounts[i]
                )
                shares += part
                for k, v in more.items() if log else ():
                    sums[k] = sums[k] + v.double() if k in sums else v.double()
            finally:
                for r in received:
                    r.release()
        parallelize.sync_replicated_grads(self.model, self.replicated_grads, self.mesh.tp)
        grad_norm = parallelize.clip_grad_norm_(
            list(self.model.parameters()), self.cfg.optim.grad_clip
        )
        names = self._loss_sum_names(sums) if log else []
        if names:
            zero = shares.new_zeros(())
            shares = torch.cat([shares, torch.stack([sums.get(k, zero) for k in names])])
        self.mesh.sum_over_tokens_(shares)
        nums = read_step(shares, counts, grad_norm, n_terms=n_terms, names=names)
        self._check_counts(nums, step)
        lr = self.scheduler.get_last_lr()[0]
        applied = self._apply_or_guard(nums)
        self.step += 1
        self.tokens_seen += int(nums.counts[-1])
        if applied and self.kd_terms and self.cfg.loss.combine == "dynamic":
            kd = weighted_kd(self._kd_weight_list, nums.losses[1:-1])
            self._kd_scale = abs(nums.losses[0]) / max(abs(kd), 1e-8)  # next step's |CE|/|KD|
        if not log:
            return None
        measured = {
            **shm_usage(),
            "lr": lr,
            "step_s": time.perf_counter() - t0,
            "teacher_s": teacher_s,
            "memory_gib": peak_memory_gib(self.device),
            "epoch": self.loader.epoch,
        }
        terms = [t.name for t in self.kd_terms]
        return train_metrics(nums, terms=terms, kd_weights=self._kd_weight_list, host=measured)

    def _check_counts(self, nums: StepNumbers, step: list[Queued]) -> None:
        """Every KD term counted what its pre-count said (over the step and all ranks: every
        rank raises alike)."""
        for term, miss, count in zip(self.kd_terms, nums.missed, nums.counts[1:-1]):
            if miss:
                raise RuntimeError(
                    f"teacher {term.name}: {term.mode} counted {int(miss)} terms more or fewer "
                    f"than the pre-count of {int(count)} step {self.step + 1} was divided by "
                    f"(this rank's rows {[r for q in step for r in q.mb.rows]})"
                )

    def _apply_or_guard(self, nums: StepNumbers, *, terms: list[str] | None = None) -> bool:
        """The optimizer step, unless a loss term or the gradient norm is not finite: then stop
        (NonFiniteError), or with optim.skip_nonfinite drop the gradients and go on (the data
        is consumed, the LR schedule advances). Every rank holds the same reduced numbers, so
        every rank decides alike. True when applied. ``terms``: the KD terms' names (default:
        the off-policy teachers)."""
        terms = [t.name for t in self.kd_terms] if terms is None else terms
        found = nonfinite_terms(nums.losses, terms=terms, grad_norm=nums.grad_norm)
        if found and not self.cfg.optim.skip_nonfinite:
            last = ckpt.list_checkpoints(self.checkpointer.folder)
            last_good = last[-1][1] if last else None
            raise NonFiniteError(nonfinite_message(self.step + 1, found, last_checkpoint=last_good))
        if found:
            self.skipped_steps += 1
            self.metrics.write(
                f"step {self.step + 1}: non-finite {', '.join(found)}: skipped, no update "
                f"(optim.skip_nonfinite; {self.skipped_steps} so far)"
            )
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return not found

    def evaluate(self) -> float:
        """Held-out bits per byte of the student (same texts on every rank: FSDP collectives
        need every rank to run the same number of forwards). Whole sequences on every rank (the
        CP attention falls back to SDPA) and whole logits (TP): at the scored positions for
        text, for the microbatch's rows on conversations (as in training)."""
        with parallelize.gathered_logits(self.model):
            if self.eval_rows:
                rows = [(r["student_ids"], r["train"], r["trained_bytes"]) for r in self.eval_rows]
                return self._trained_bpb(self.model, rows, vocab_size=self.vocab_used)
            res = evaluate_bpb(
                self.model,
                self.prep.student_tok,
                self.eval_texts,
                batch_size=self.cfg.eval.batch_size,
                device=self.device,
            )
        return float(res["bpb"])

    def _trained_bpb(self, model, rows, *, vocab_size: int) -> float:
        # whole rows, as many as a training microbatch (their full logits fit, as in training)
        res = trained_bpb(
            model,
            rows,
            vocab_size=vocab_size,
            batch_size=self.cfg.data.micro_batch_size,
            device=self.device,
        )
        return float(res["bpb"])

    def teacher_bpb(self) -> dict[str, float]:
        """The teachers' held-out BPB (once per run, for reference), computed on rank 0 with an
        unsharded copy of each teacher and broadcast. Not for a teacher read from a cache: its
        weights are never loaded."""
        result: dict[str, float] = {}
        if self.is_main:
            for i, (t_cfg, tok) in enumerate(zip(self.cfg.teachers, self.prep.teacher_toks)):
                if t_cfg.cache:
                    continue
                model = models.freeze(models.build_model(t_cfg, device=self.device))
                if self.eval_rows:  # its own tokens and train codes, the same trained bytes
                    rows = [
                        (r["teachers"][i]["ids"], r["teachers"][i]["train"], r["trained_bytes"])
                        for r in self.eval_rows
                    ]
                    result[t_cfg.name] = self._trained_bpb(model, rows, vocab_size=tok.vocab_size)
                else:
                    res = evaluate_bpb(
                        model,
                        tok,
                        self.eval_texts,
                        batch_size=self.cfg.eval.batch_size,
                        device=self.device,
                    )
                    result[t_cfg.name] = float(res["bpb"])
                del model
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _export(self, name: str = "export") -> Path:
        extra = {"step": self.step, "run": self.cfg.name}
        out = self.run_dir / name
        return ckpt.export_student(
            self.model, self.cfg.model, out, extra=extra, is_main=self.is_main
        )

    def _out_of_time(self, t_start: float) -> bool:
        """Has any rank spent ``time_budget_s`` in steps? (One decision for every rank.)"""
        over = torch.tensor(
            [float(time.perf_counter() - t_start >= self.cfg.time_budget_s)], device=self.device
        )
        world = dist.group.WORLD if dist.is_initialized() else None
        return bool(all_reduce_(over, world).item() > 0)

    def train(self) -> dict:
        """Run to `steps` (or `stop_after`): eval before, train, eval/checkpoint, export, summary."""
        cfg = self.cfg
        end = cfg.stop_after or cfg.steps
        do_eval = bool(self.eval_texts)
        bpb = read_bpb(self.run_dir, fresh=self.resumed_from is None)
        if do_eval and "student_before" not in bpb and self.step == 0:
            bpb["student_before"] = self.evaluate()
            self.metrics.log(self.step, {"bpb": bpb["student_before"]}, kind="eval")
        if do_eval and cfg.eval.teacher and cfg.teachers and "teachers" not in bpb:
            bpb["teachers"] = self.teacher_bpb()
            self.metrics.log(
                self.step, {f"bpb/{k}": v for k, v in bpb["teachers"].items()}, kind="eval"
            )
        if self.onpolicy is not None and "teacher_on_student_before" not in bpb and self.step == 0:
            bpb["teacher_on_student_before"] = self.onpolicy.evaluate()
        write_bpb(self.run_dir, bpb, enabled=self.is_main)
        t_start, first_step = time.perf_counter(), self.step
        last_ckpt = None
        out_of_time = False
        while self.step < end:
            nxt = self.step + 1
            log = nxt % cfg.logging.interval == 0 or nxt == end
            if self.onpolicy is not None and self.onpolicy.takes_step():
                m = self.onpolicy.step(log=log, last=nxt == cfg.steps)
            else:
                m = self.train_step(log=log)
            if m is not None:  # a logging step
                self.metrics.log(self.step, m)
            self.metrics.advance()
            if (
                cfg.eval.interval
                and self.step % cfg.eval.interval == 0
                and self.step < end
                and do_eval
            ):
                self.metrics.log(self.step, {"bpb": self.evaluate()}, kind="eval")
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                last_ckpt = self.save_checkpoint()
            if m is not None and ckpt.export_requested(
                self.run_dir, device=self.device, is_main=self.is_main
            ):
                self.metrics.write(f"exported: {self._export(f'export-step-{self.step}')}")
            if cfg.time_budget_s is not None and self.step < end and self._out_of_time(t_start):
                out_of_time = True
                break
        train_s = time.perf_counter() - t_start
        if cfg.checkpoint.save_at_end and (
            last_ckpt is None or not last_ckpt.name.endswith(f"{self.step:08d}")
        ):
            last_ckpt = self.save_checkpoint()
        finished = self.step == cfg.steps or out_of_time
        if do_eval and finished:
            bpb["student_after"] = self.evaluate()
            self.metrics.log(self.step, {"bpb": bpb["student_after"]}, kind="eval")
            if self.onpolicy is not None:
                bpb["teacher_on_student_after"] = self.onpolicy.evaluate()
            write_bpb(self.run_dir, bpb, enabled=self.is_main)
        export = self._export() if cfg.checkpoint.export_at_end and finished else None
        summary = {
            "name": cfg.name,
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "train_seconds": round(train_s, 1),
            "out_of_time": out_of_time,
            "tokens": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "bpb": bpb,
            "eval_texts": len(self.eval_texts),
            "eval_bytes": (
                sum(r["trained_bytes"] for r in self.eval_rows)
                if self.eval_rows
                else sum(len(t.encode("utf-8")) for t in self.eval_texts)
            ),
            "metrics": str(self.metrics.jsonl_path) if cfg.logging.jsonl else None,
            "tensorboard": str(self.metrics.tb_dir) if cfg.logging.tensorboard else None,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "export": str(export) if export else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "shards": str(Path(self.prep.shards.dir).resolve()),  # the run report's chunk stats
            "teachers": [t.name for t in cfg.teachers],
            "integrity": integrity.COST.to_json(),  # this rank's checksum cost (docs/integrity.md)
        }
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.metrics.close()
            summary["report"] = report.after_run(self.run_dir)  # never raises: logs one line
            print(format_summary(summary), flush=True)
        return summary

    def close(self) -> None:
        """Stop teacher workers, free channel buffers, close writers (safe after errors)."""
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c.close()
        self._closers.clear()
