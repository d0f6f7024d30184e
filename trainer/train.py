"""The training loop: the verbs forward_backward_step, train_step, train, state_dict, load_state_dict.

Build order (`Trainer.__init__`): process group and mesh -> data -> student (TP plan, then
FSDP2) -> optimizer and LR schedule -> teacher channels (a worker process per rank, or
in-process) -> resume. Every file and fingerprint check ran before, in `trainer.preflight`.

The loss invariant, where it holds: each term is a local SUM divided by the GLOBAL count of its
step (summed over the step's microbatches and all-reduced over the data-parallel ranks, never
over tensor-parallel ones), known before the first backward of the step because counts depend
on the batch only. FSDP sums (does not average) gradients, so the result is the gradient of the
global mean, for any microbatch split and any dp size.

The teacher runs ahead: microbatches are drawn from the data stream into a small queue and
submitted to the teacher channels as soon as a slot is free, so the teacher's forward on the
next microbatch overlaps the student's step on this one. A checkpoint records the data position
before the first queued-but-unused microbatch.

Legend: B rows, T student positions, V student vocabulary (lm_head width).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer import checkpoint as ckpt
from trainer import models, parallel, report
from trainer.channel import SHM_PREFIX
from trainer.config import TrainConfig
from trainer.data import MicrobatchLoader, ShardReader, ShardStream, pad_id
from trainer.distill import (
    Feed,
    KDTerm,
    Queued,
    build_kd_terms,
    ce_term,
    combine_terms,
    open_teachers,
    teacher_weights,
)
from trainer.eval import evaluate_bpb
from trainer.losses.teacher_outputs import TeacherOutputs
from trainer.metrics import MetricsLogger, format_summary, peak_memory_gib
from trainer.preflight import Prepared

EXPORT_REQUEST = "EXPORT"  # touch <run_dir>/EXPORT to export the student after the current step


def lr_lambda(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup, then cosine to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def shm_usage() -> dict[str, float]:
    """This process's shared-memory segments (teacher channel rings): count and bytes. Constant
    over a run when slots are reused, never re-allocated."""
    prefix = f"{SHM_PREFIX}{os.getpid()}_"
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return {}
    sizes = [p.stat().st_size for p in shm.iterdir() if p.name.startswith(prefix)]
    return {"shm_segments": len(sizes), "shm_bytes": sum(sizes)}


class Trainer:
    """One run of `cfg` on this rank. Use: ``t = Trainer(cfg, prepared); try: t.train()
    finally: t.close()``."""

    def __init__(self, cfg: TrainConfig, prepared: Prepared):
        self.cfg = cfg
        self.prep = prepared
        self.device = parallel.pick_device(cfg.device)
        self.rank, self.world = parallel.init_distributed(self.device)
        if cfg.parallel.threads:
            torch.set_num_threads(cfg.parallel.threads)
        dp, tp = cfg.parallel.mesh_shape(self.world)
        self.mesh = parallel.build_mesh(self.device, dp=dp, tp=tp)
        self.run_dir = Path(cfg.run_dir)
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
        self.step = 0
        self.tokens_seen = 0
        self._closers: list[Any] = []
        try:
            self._build(cfg, prepared, tp)
        except BaseException:
            self.close()  # teacher workers and shared memory must not outlive a failed build
            raise

    def _build(self, cfg: TrainConfig, prepared: Prepared, tp: int) -> None:
        # data: this dp rank's share of the shards
        reader = ShardReader(prepared.shards, max_student_tokens=cfg.data.max_student_tokens)
        stream = ShardStream(
            reader,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dp_size,
            seed=cfg.data.seed,
            shuffle_buffer=cfg.data.shuffle_buffer,
            eval_fraction=cfg.data.eval_fraction,
        )
        self.loader = MicrobatchLoader(
            stream,
            micro_batch_size=cfg.data.micro_batch_size,
            student_pad=pad_id(prepared.student_tok),
            teacher_pads=[pad_id(t) for t in prepared.teacher_toks],
            pad_to_multiple=cfg.data.pad_to_multiple,
        )
        self.eval_texts = self.loader.eval_texts(cfg.eval.max_texts)
        mult = cfg.data.pad_to_multiple
        teacher_max = [-(-n // mult) * mult for n in prepared.teacher_max_len]

        # student: TP plan, then FSDP2
        self.model = models.build_model(cfg.model, device=self.device)
        self.vocab_V = models.vocab_width(self.model)
        self.vocab_used = prepared.student_tok.vocab_size
        self.model.train()
        plan = parallel.tp_plan(self.model.config.model_type) if tp > 1 else {}
        self.replicated_grads = parallel.apply_tp(self.model, self.mesh.tp, plan)
        mp = MixedPrecisionPolicy(
            param_dtype=models.torch_dtype(cfg.parallel.param_dtype),
            reduce_dtype=models.torch_dtype(cfg.parallel.reduce_dtype),
        )
        parallel.apply_fsdp(
            self.model,
            self.mesh.dp,
            mp_policy=mp,
            reshard_after_forward=cfg.parallel.reshard_after_forward,
        )
        o = cfg.optim
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]  # norms, biases
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(
                s, warmup=o.warmup_steps, total=cfg.steps, min_ratio=o.min_lr_ratio
            ),
        )

        # teachers and loss terms
        self.kd_terms: list[KDTerm] = build_kd_terms(cfg, prepared, device=self.device)
        self.kd_weights = teacher_weights(cfg, self.kd_terms) if self.kd_terms else None
        self._kd_scale: float | None = None  # dynamic combine: last step's |CE| / |KD|
        self.channels = open_teachers(
            cfg,
            self.kd_terms,
            device=self.device,
            rank=self.rank,
            world=self.world,
            max_len=teacher_max,
            threads=cfg.parallel.threads or None,
        )
        self._closers += self.channels
        self.feed = Feed(self.loader, self.kd_terms, self.channels, device=self.device)

        self.checkpointer = ckpt.Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint, rank=self.rank
        )
        self.resumed_from = self.checkpointer.resume_path()
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
        return {
            "app": ckpt.ModelOptimState(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            f"rank{self.rank}": {"data": position["position"], "rng": ckpt.rng_state()},
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

    def load_state_dict_from(self, path: Path) -> None:
        state = self.state_dict()
        self.checkpointer.load(path, state)
        self.load_state_dict(state)

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.state_dict())

    # ---------------------------------------------------------------------------------------
    # data + teacher pipeline

    # ---------------------------------------------------------------------------------------
    # the verbs

    def forward_backward_step(
        self, q: Queued, teacher_outputs: list[TeacherOutputs], *, counts: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Forward + backward of one microbatch. Returns each term's share of the step loss
        (local sum / global count; [ce, kd_0.., total], detached) and the losses' own metric
        sums (additive: summed over microbatches and ranks by the caller)."""
        mb = q.mb
        logits_BTV = self.model(
            input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT, use_cache=False
        ).logits
        if self.kd_terms and self.cfg.loss.ce_weight == 0:
            with torch.no_grad():  # CE is always reported, but needs no graph here
                ce_out = ce_term(logits_BTV.detach(), mb, vocab_size=self.vocab_used)
        else:
            ce_out = ce_term(logits_BTV, mb, vocab_size=self.vocab_used)
        kd_outs = []
        for i, (term, outs) in enumerate(zip(self.kd_terms, teacher_outputs)):
            out = term.loss(logits_BTV, outs, q.prep[i])
            if int(out.count) != term.count(q.prep[i]):  # the count the step was divided by
                raise RuntimeError(
                    f"teacher {term.name}: {term.mode} counted {int(out.count)} terms, the "
                    f"pre-count said {term.count(q.prep[i])} (rows {mb.rows})"
                )
            kd_outs.append(out)
        total, parts = combine_terms(
            self.cfg.loss,
            ce_out,
            kd_outs,
            counts=counts,
            weights=self.kd_weights,
            scale=self._kd_scale,
        )
        total.backward()
        extra = {}
        for term, out in zip(self.kd_terms, kd_outs):
            extra.update({f"{term.name}/{k}": float(v) for k, v in out.metrics.items()})
        return torch.stack([*parts, total.detach()]).double(), extra

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `grad_accum` microbatches on every dp rank."""
        t0 = time.perf_counter()
        n_mb = self.cfg.data.grad_accum
        step = self.feed.peek(n_mb)
        # every term's global count, known before the first backward: [ce, kd_0.., tokens]
        local = torch.tensor(
            [
                [q.mb.num_targets, *(t.count(p) for t, p in zip(self.kd_terms, q.prep))]
                + [int(q.mb.attention_mask_BT.sum())]
                for q in step
            ],
            dtype=torch.float64,
        ).sum(0)
        counts = parallel.all_reduce_sum(local.to(self.device), self.mesh.dp_group)
        shares = torch.zeros(2 + len(self.kd_terms), dtype=torch.float64, device=self.device)
        extra: dict[str, float] = {}
        teacher_s = 0.0
        for i in range(n_mb):
            # reduce-scatter the gradients once per step, after the last microbatch
            self.model.set_requires_gradient_sync(i == n_mb - 1)
            q, received = self.feed.next()
            try:
                outs = [TeacherOutputs(**r.outputs) for r in received]
                teacher_s += sum(r.teacher_s for r in received)
                part, more = self.forward_backward_step(q, outs, counts=counts[:-1])
                shares += part
                for k, v in more.items():
                    extra[k] = extra.get(k, 0.0) + v
            finally:
                for r in received:
                    r.release()
        parallel.sync_replicated_grads(self.model, self.replicated_grads, self.mesh.tp_group)
        grad_norm = parallel.clip_grad_norm_(
            list(self.model.parameters()), self.cfg.optim.grad_clip
        )
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        parallel.all_reduce_sum(shares, self.mesh.dp_group)
        tokens = int(counts[-1])
        self.tokens_seen += tokens
        dt = time.perf_counter() - t0
        m = {"loss": float(shares[-1]), "ce": float(shares[0])}
        if self.kd_terms:
            kd_means = [float(x) for x in shares[1:-1]]
            for t, v, c in zip(self.kd_terms, kd_means, counts[1:-1]):
                m[f"kd/{t.name}"] = v
                # alignment coverage: KD terms (tokens or chunks) per student target token
                m[f"coverage/{t.name}"] = float(c) / max(1.0, float(counts[0]))
            kd = float(sum(w * v for w, v in zip(self.kd_weights.tolist(), kd_means)))
            m["kd"] = kd
            if self.cfg.loss.combine == "dynamic":
                self._kd_scale = abs(m["ce"]) / max(abs(kd), 1e-8)
        m.update(
            **shm_usage(),
            grad_norm=float(grad_norm),
            lr=lr,
            tokens=tokens,
            tokens_per_s=tokens / dt,
            step_s=dt,
            teacher_s=teacher_s,
            memory_gib=peak_memory_gib(self.device),
            epoch=self.loader.epoch,
        )
        # the losses' own metric sums over all dp ranks (their keys may differ between ranks,
        # e.g. a chain term only where multi-token chunks occurred: gathered as objects), per term
        if self.kd_terms and self.mesh.dp_size > 1:
            every: list[dict[str, float]] = [{} for _ in range(self.mesh.dp_size)]
            dist.all_gather_object(every, extra, group=self.mesh.dp_group)
            extra = {}
            for d in every:
                for k, v in d.items():
                    extra[k] = extra.get(k, 0.0) + v
        for t, c in zip(self.kd_terms, counts[1:-1]):
            for k, v in extra.items():
                if k.startswith(f"{t.name}/") and k.endswith("_sum"):
                    m[f"{k[: -len('_sum')]}_mean"] = v / max(1.0, float(c))
        return m

    def evaluate(self) -> float:
        """Held-out bits per byte of the student (same texts on every rank: FSDP collectives
        need every rank to run the same number of forwards)."""
        res = evaluate_bpb(
            self.model,
            self.prep.student_tok,
            self.eval_texts,
            batch_size=self.cfg.eval.batch_size,
            device=self.device,
        )
        return float(res["bpb"])

    def teacher_bpb(self) -> dict[str, float]:
        """The teachers' held-out BPB (once per run, for reference), computed on rank 0 with an
        unsharded copy of each teacher and broadcast."""
        result: dict[str, float] = {}
        if self.is_main:
            for t_cfg, tok in zip(self.cfg.teachers, self.prep.teacher_toks):
                model = models.freeze(models.build_model(t_cfg, device=self.device))
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

    def export_requested(self) -> bool:
        """True on every rank when rank 0 sees ``<run_dir>/EXPORT`` (``touch`` it to ask for
        an export of the student at the end of the current step); the file is removed."""
        flag = torch.zeros(1, device=self.device)
        request = self.run_dir / EXPORT_REQUEST
        if self.is_main and request.exists():
            request.unlink()
            flag += 1
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _export(self, name: str = "export") -> Path:
        """The student as a plain HF directory <run_dir>/<name> (collective)."""
        sd = ckpt.full_model_state_dict(self.model)
        out = self.run_dir / name
        if self.is_main:
            models.export_hf(
                sd, cfg=self.cfg.model, out_dir=out, extra={"step": self.step, "run": self.cfg.name}
            )
        dist.barrier()
        return out

    def _bpb_state(self) -> dict:
        """BPB measured earlier in this run (kept across a resume, never across fresh starts)."""
        path = self.run_dir / "bpb.json"
        fresh = self.resumed_from is None
        return json.loads(path.read_text()) if path.is_file() and not fresh else {}

    def _save_bpb_state(self, state: dict) -> None:
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "bpb.json").write_text(json.dumps(state, indent=2))

    def train(self) -> dict:
        """Run to `steps` (or `stop_after`): eval before, train, eval/checkpoint, export, summary."""
        cfg = self.cfg
        end = cfg.stop_after or cfg.steps
        do_eval = bool(self.eval_texts)
        bpb = self._bpb_state()
        if do_eval and "student_before" not in bpb and self.step == 0:
            bpb["student_before"] = self.evaluate()
            self.metrics.log(self.step, {"bpb": bpb["student_before"]}, kind="eval")
        if do_eval and cfg.eval.teacher and cfg.teachers and "teachers" not in bpb:
            bpb["teachers"] = self.teacher_bpb()
            self.metrics.log(
                self.step, {f"bpb/{k}": v for k, v in bpb["teachers"].items()}, kind="eval"
            )
        self._save_bpb_state(bpb)
        t_start, first_step = time.perf_counter(), self.step
        last_ckpt = None
        while self.step < end:
            m = self.train_step()
            if self.step % cfg.logging.interval == 0 or self.step == end:
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
            if self.export_requested():
                self.metrics.write(
                    f"exported the student: {self._export(f'export-step-{self.step}')}"
                )
        train_s = time.perf_counter() - t_start
        if cfg.checkpoint.save_at_end and (
            last_ckpt is None or not last_ckpt.name.endswith(f"{self.step:08d}")
        ):
            last_ckpt = self.save_checkpoint()
        if do_eval and self.step == cfg.steps:
            bpb["student_after"] = self.evaluate()
            self.metrics.log(self.step, {"bpb": bpb["student_after"]}, kind="eval")
            self._save_bpb_state(bpb)
        export = self._export() if cfg.checkpoint.export_at_end and self.step == cfg.steps else None
        summary = {
            "name": cfg.name,
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "train_seconds": round(train_s, 1),
            "tokens": self.tokens_seen,
            "bpb": bpb,
            "eval_texts": len(self.eval_texts),
            "eval_bytes": sum(len(t.encode("utf-8")) for t in self.eval_texts),
            "metrics": str(self.metrics.jsonl_path) if cfg.logging.jsonl else None,
            "tensorboard": str(self.metrics.tb_dir) if cfg.logging.tensorboard else None,
            "checkpoint": str(last_ckpt) if last_ckpt else None,
            "export": str(export) if export else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "shards": str(Path(self.prep.shards.dir).resolve()),  # the run report's chunk stats
            "teachers": [t.name for t in cfg.teachers],
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
