"""The training loop: the verbs train_step, train, evaluate, state_dict, load_state_dict.

`Trainer` builds a run on this rank, once preflight has checked every file: the mesh, the data,
the student (built on the meta device, parallelized, filled), the optimizer, the teachers, the
one step and its sources of microbatches, then the resume. Each source gets what it needs by
keyword and holds no `Trainer`; `train` picks one per step (GKD's lambda) and
`trainer.step.TrainStep` runs it (docs/design.md, "One training step"; docs/training.md).
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tokenbridge import models
from tokenbridge.dist_ops.collectives import all_reduce_
from tokenbridge.formats import checksums
from trainer import optim, report
from trainer.checkpoint import checkpointer
from trainer.checkpoint.shared_dir import check_shared
from trainer.config.schema import TrainConfig
from trainer.data.microbatches import MicrobatchLoader, pad_id
from trainer.data.packing import PackedLoader, PackLimits, teacher_limits
from trainer.data.shard_reader import ShardReader, ShardStream
from trainer.data.shard_source import ShardSource
from trainer.eval import evaluate_bpb, trained_bpb
from trainer.loss_terms import KDTerm, build_kd_terms
from trainer.parallel import cpus, parallelize
from trainer.parallel.materialize import load_record
from trainer.parallel.mesh import build_mesh
from trainer.parallel.sharded_build import build_student, build_teacher
from trainer.preflight import Prepared
from trainer.run_log import MetricsLogger, format_summary, read_bpb, write_bpb
from trainer.step import TrainStep
from trainer.teacher.dispatch import Feed, open_teachers
from trainer.throughput import Throughput


def _live_teachers(cfg: TrainConfig, prepared: Prepared) -> int:
    """Off-policy KD teachers run live (by a worker or in process), not read from a cache nor
    served."""
    if not cfg.kd_enabled:
        return 0
    return sum(t.weight != 0 and not off for t, off in zip(cfg.teachers, _offline(cfg, prepared)))


def _offline(cfg: TrainConfig, prepared: Prepared) -> list:
    """Per teacher: its cache or its server when it has one (no weights load here), else None."""
    caches = prepared.caches or [None] * len(cfg.teachers)
    return [c if c is not None else t.server for t, c in zip(cfg.teachers, caches)]


class Trainer:
    """One run of `cfg` on this rank. Use: ``t = Trainer(cfg, prepared); try: t.train()
    finally: t.close()``."""

    def __init__(self, cfg: TrainConfig, prepared: Prepared):
        self.cfg = cfg
        self.prep = prepared
        self.device = parallelize.pick_device(cfg.device)
        self.rank, self.world = parallelize.init_distributed(
            self.device, timeout_s=cfg.parallel.collective_timeout_s
        )
        # several nodes: a local checkpoint dir must be one they all share (refused otherwise)
        check_shared(checkpointer.folder_of(cfg.run_dir, cfg.checkpoint))
        # the student's and its teacher workers' threads (`trainer.parallel.cpus`)
        self.cpus = cpus.plan_for(
            cfg, device=self.device, live_teachers=_live_teachers(cfg, prepared)
        )
        if self.cpus.student is not None:
            torch.set_num_threads(self.cpus.student)
        dp, cp, tp = cfg.parallel.mesh_shape(self.world)
        self.mesh = build_mesh(
            self.device, dp=dp, cp=cp, tp=tp, replicate=cfg.parallel.dp_replicate
        )
        self.run_dir = Path(cfg.run_dir)
        self.is_main = self.rank == 0
        torch.manual_seed(cfg.seed)
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
            reader, data=cfg.data, dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size
        )
        batching = {
            "micro_batch_size": cfg.data.micro_batch_size,
            "student_pad": pad_id(prepared.student_tok),
            "teacher_pads": [pad_id(t) for t in prepared.teacher_toks],
            "pad_to_multiple": cfg.data.pad_to_multiple,
        }
        teacher_rows = list(prepared.teacher_max_len)
        if cfg.data.packing:
            limits = PackLimits(
                cfg.data.row_tokens,
                teacher_limits(
                    cfg.data.row_tokens,
                    student_max=reader.max_lengths()[0],
                    teacher_max=prepared.teacher_max_len,
                ),
            )
            teacher_rows = list(limits.teachers)  # sizes the teachers' channel slots
            self.loader = PackedLoader(
                stream, limits=limits, buffer=cfg.data.pack_buffer, **batching
            )
        else:
            self.loader = MicrobatchLoader(stream, **batching)
        self.eval_texts = self.loader.eval_texts(cfg.eval.max_texts)
        # conversation shards: bits per byte of the trained contents (`trained_bpb`)
        self.eval_rows = self.loader.eval_rows(cfg.eval.max_texts) if reader.is_chat else []
        mult = cfg.data.pad_to_multiple
        teacher_max = [-(-n // mult) * mult for n in teacher_rows]

        # student: built on the meta device, TP plan, CP attention, activation checkpointing,
        # compile, FSDP2, then this rank's shards materialized and filled
        # (`trainer.parallel.sharded_build`; left unfilled when a checkpoint is loaded below)
        precision = prepared.precision  # resolved for this device (trainer.config.precision)
        self.model, self.replicated_grads = build_student(
            cfg.model,
            mesh=self.mesh,
            parallel=cfg.parallel,
            precision=precision,
            device=self.device,
            fill=prepared.resume is None,
        )
        self.vocab_V = models.vocab_width(self.model)
        self.vocab_used = prepared.student_tok.vocab_size
        self.optimizer = optim.build_optimizer(
            self.model, cfg.optim, fused=precision.fused_optimizer
        )
        self.scheduler = optim.build_scheduler(self.optimizer, cfg.optim, steps=cfg.steps)

        # teachers and loss terms
        self.kd_terms: list[KDTerm] = build_kd_terms(cfg, prepared, device=self.device)
        self.channels = open_teachers(
            cfg,
            self.kd_terms,
            device=self.device,
            rank=self.rank,
            world=self.world,
            max_len=teacher_max,
            threads=self.cpus.worker,
            caches=prepared.caches,
            batch_group=self.mesh.batch,
            dtypes=precision.teacher_dtypes,
        )
        self._closers += self.channels
        # the teachers run ahead: the feed queues microbatches and submits each as soon as a slot
        # is free, so a teacher's next forward overlaps the student's step on this one
        self.feed = Feed(self.loader, self.kd_terms, self.channels, device=self.device)
        # per-device tokens/s and MFU of the records
        self.throughput = Throughput.of(
            world=self.world,
            student=self.model.config,
            terms=self.kd_terms,
            teachers=cfg.teachers,
            caches=_offline(cfg, prepared),
            device=self.device,
            dtype=precision.param_dtype,
            peak_tflops=cfg.logging.peak_tflops,
        )

        # the one step, and its two sources of microbatches: the shards, and (trainer.onpolicy)
        # the student's rollouts, with their prompts, sampler and teacher channels
        self.checkpointer = checkpointer.Checkpointer(
            checkpointer.folder_of(cfg.run_dir, cfg.checkpoint), cfg.checkpoint, rank=self.rank
        )
        self.resumed_from = prepared.resume  # verified by preflight (checkpoint.find_resume)
        self.metrics = MetricsLogger(
            self.run_dir,
            enabled=self.is_main,
            jsonl=cfg.logging.jsonl,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            total_steps=cfg.stop_after or cfg.steps,
            fresh=self.resumed_from is None,
        )
        self._closers.append(self.metrics)
        for i, served in enumerate(prepared.served):
            if served:
                self.metrics.write(
                    f"teachers[{i}]: served by {served['server']} (model {served['model']}, "
                    f"max_model_len {served['max_model_len']}, probe latency "
                    f"{served['latency_s'] * 1e3:.0f} ms)"
                )
        self.stepper = TrainStep(
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            mesh=self.mesh,
            replicated_grads=self.replicated_grads,
            optim=cfg.optim,
            checkpoints=self.checkpointer.folder,
            device=self.device,
            say=self.metrics.write,
        )
        self.shards = ShardSource(
            model=self.model,
            terms=self.kd_terms,
            feed=self.feed,
            loader=self.loader,
            mesh=self.mesh,
            data=cfg.data,
            loss=cfg.loss,
            parallel=cfg.parallel,
            vocab_size=self.vocab_used,
            throughput=self.throughput,
            device=self.device,
        )
        self.onpolicy = None
        if cfg.onpolicy.enabled:
            # imported here: the sampler, rollouts and realignment are ~1 s of imports that an
            # off-policy run (and each of its ranks) does not need
            from trainer.onpolicy.side import open_onpolicy

            self.onpolicy = open_onpolicy(
                cfg,
                prepared,
                model=self.model,
                mesh=self.mesh,
                loader=self.loader,
                stepper=self.stepper,
                throughput=self.throughput,
                cpus=self.cpus,
                device=self.device,
            )
            self._closers.append(self.onpolicy)

        if self.resumed_from is not None:
            self.load_state_dict_from(self.resumed_from)
        self.metrics.start(self.step)
        self.metrics.log(self.step, load_record(self.device), kind="load")

    # ---------------------------------------------------------------------------------------
    # state

    @property
    def step(self) -> int:
        """Optimizer steps taken (counted by `trainer.step.TrainStep` alone)."""
        return self.stepper.step

    @property
    def tokens_seen(self) -> int:
        return self.stepper.tokens_seen

    @property
    def skipped_steps(self) -> int:
        """Non-finite steps skipped (``optim.skip_nonfinite``)."""
        return self.stepper.skipped_steps

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs: the Stateful model+optim and, per rank, plain values
        and tensors (`trainer.checkpoint.checkpointer`: stored as tensors and JSON, nothing pickled)."""
        position = self.feed.position()
        mine = {"data": position["position"], "rng": checkpointer.rng_state()}
        if self.onpolicy is not None:
            mine["onpolicy"] = self.onpolicy.state_dict()
        return {
            "app": checkpointer.ModelOptimState(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            **self.stepper.state_dict(),  # step, tokens_seen
            f"rank{self.rank}": mine,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a loaded state (the model and optimizer were filled in place by DCP)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.stepper.load_state_dict(state)
        mine = state[f"rank{self.rank}"]
        self.feed.reset()
        self.loader.load_state_dict({"position": mine["data"]})
        checkpointer.set_rng_state(mine["rng"])
        if self.onpolicy is not None:
            self.onpolicy.load_state_dict(mine["onpolicy"])

    def load_state_dict_from(self, path: Path) -> None:
        state = self.state_dict()
        if checkpointer.saved_world(path) == self.world:
            self.checkpointer.load(path, state)
            self.load_state_dict(state)
            return
        # saved by another number of processes: DCP reshards the student and the optimizer;
        # the common values come from rank 0's file, the data position is carried over where
        # that is exact (`ShardStream.reshard`); RNG states and the on-policy position restart
        del state[f"rank{self.rank}"]
        self.checkpointer.load(path, state, from_rank=0)
        self.scheduler.load_state_dict(state["scheduler"])
        self.stepper.load_state_dict(state)
        self.feed.reset()
        note = self.loader.reshard(checkpointer.saved_positions(path))
        if self.is_main:
            print(
                f"resumed {path.name}, saved by {checkpointer.saved_world(path)} processes, on "
                f"{self.world}: student and optimizer resharded" + (f"; {note}" if note else ""),
                flush=True,
            )

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.step, self.state_dict())

    # ---------------------------------------------------------------------------------------
    # the verbs

    def train_step(self, *, log: bool = True) -> dict[str, float] | None:
        """One optimizer step over `data.grad_accum` shard microbatches on every dp rank
        (`trainer.step.TrainStep.run`); its metrics on a logging step, else None."""
        return self.stepper.run(self.shards, log=log)

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
        """The teachers' held-out BPB (once per run, for reference), broadcast from rank 0. A
        teacher at tp = 1 is built whole, on rank 0 alone; one at tp > 1 (larger than a device)
        on every rank, sharded over TP groups as its workers hold it and loaded by shards
        (`build_teacher`), each group scoring the same texts. Not for a teacher read from a
        cache: its weights are never loaded."""
        result: dict[str, float] = {}
        for i, (t_cfg, tok) in enumerate(zip(self.cfg.teachers, self.prep.teacher_toks)):
            if t_cfg.cache or t_cfg.server or (t_cfg.tp == 1 and not self.is_main):
                continue
            tp_mesh = None
            if t_cfg.tp > 1:  # collective: every rank builds its TP group's shards
                tp_mesh = build_mesh(self.device, dp=self.world // t_cfg.tp, tp=t_cfg.tp).tp_mesh
            dtype = self.prep.precision.teacher_dtypes[i]
            model = build_teacher(t_cfg, dtype=dtype, device=self.device, tp_mesh=tp_mesh)
            with parallelize.gathered_logits(model):
                if self.eval_rows:  # its own tokens and train codes, the same trained bytes
                    rows = [
                        (r["teachers"][i]["ids"], r["teachers"][i]["train"], r["trained_bytes"])
                        for r in self.eval_rows
                    ]
                    bpb = self._trained_bpb(model, rows, vocab_size=tok.vocab_size)
                else:
                    res = evaluate_bpb(
                        model,
                        tok,
                        self.eval_texts,
                        batch_size=self.cfg.eval.batch_size,
                        device=self.device,
                    )
                    bpb = float(res["bpb"])
            result[t_cfg.name] = bpb
            del model
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _export(self, name: str = "export") -> Path:
        extra = {"step": self.step, "run": self.cfg.name}
        out = self.run_dir / name
        return checkpointer.export_student(
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
        # rank 0's: every rank takes the same eval decisions, whether or not the nodes share
        # the run directory
        box = [read_bpb(self.run_dir, fresh=self.resumed_from is None) if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        bpb = box[0]
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
            if m is not None and checkpointer.export_requested(
                self.run_dir, device=self.device, is_main=self.is_main
            ):
                self.metrics.write(f"exported: {self._export(f'export-step-{self.step}')}")
            if cfg.time_budget_s is not None and self.step < end and self._out_of_time(t_start):
                out_of_time = True
                break
        train_s = time.perf_counter() - t_start
        if cfg.checkpoint.save_at_end and (
            last_ckpt is None or not str(last_ckpt).endswith(f"{self.step:08d}")
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
            # what was computed in, and how fast each device went (trainer.config.precision,
            # trainer.throughput: medians over the logged steps)
            "precision": self.prep.precision.summary([t.name for t in cfg.teachers]),
            "throughput": self.throughput.summary(),
            "integrity": checksums.COST.to_json(),  # this rank's checksum cost (docs/integrity.md)
        }
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            self.metrics.close()
            if cfg.logging.report:
                summary["report"] = report.after_run(self.run_dir)  # never raises: logs one line
            print(format_summary(summary), flush=True)
        return summary

    def close(self) -> None:
        """Stop teacher workers, free channel buffers, close writers (safe after errors)."""
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c.close()
        self._closers.clear()
