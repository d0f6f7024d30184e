"""The trainer under TP, CP and DP, run as `trainer/main.py` runs it (a script, not a test module).

``python tests/dist/parallel_trainer_cases.py SET SHARDS PROJECTION OUT`` (SET = ``ref``, one
process) or ``python -m torch.distributed.run --nproc_per_node=N ... SET ...`` (SET = ``two``,
``four``) runs, one after another in one process group, the runs of SET as main() does (config
-> preflight -> Trainer -> train -> close) and leaves each run's folder (metrics.jsonl,
checkpoints, export) under OUT/<run>; tests/dist/test_parallel_trainer.py compares them.

Every run sees the same global batch (4 rows per step, 2 microbatches) and distils from four
tiny same-tokenizer teachers at once, one per loss mode (kd_topk, xtoken, gold, alm: each KD term
is logged on its own), so one run covers every mode. Probes record, per rank and training
forward, the logits' local shape and DTensor placement, the decoder activations' length, any
module output as wide as the whole vocabulary and the row counts its teachers were given
(``probes/rank<r>.json``). The ``two`` set also compares cp = 2 and tp = 2 forwards and
gradients of tiny tied Llama and sliding-window Gemma 3 models with the whole model
(``model_checks.json``), and the ``two`` and ``four`` sets gather the student and a teacher
built on the meta device and filled shard by shard under FSDP, TP and both
(``weights_<set>.json``: equal to `build_model`'s weights or not). ``resize`` runs 3 steps on
2, then 1, then 2 processes (the 1-process part is this script again, ``one``, started by rank 0
of the ``two`` launch), each resuming the checkpoint of the part before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# run as a script (torchrun): import this checkout's packages, not an installed copy's
if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.zygote import SHIM, SHIM_SOCKET
from tokenbridge import paths
from trainer.config.schema import from_dictconfig
from trainer.loop import Trainer
from trainer.parallel import parallelize
from trainer.preflight import preflight

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # larger weights than HF's 0.02: peaked distributions, so every KD term is O(1) and a
    # relative tolerance compares real values, not float noise around zero
    "initializer_range": 0.2,
}
MODES = ("kd_topk", "xtoken", "gold", "alm")
STEPS = 2


def make_cfg(shards: str, projection: str, run_dir: str, *, layout: dict, **top) -> object:
    student = str(paths.student_dir())
    teacher_tp = layout.pop("teacher_tp", 1)
    steps = layout.pop("steps", STEPS)
    teacher_bpb = layout.pop("teacher_bpb", False)
    grad_accum = layout.pop("ga", 2)
    teachers = [
        {
            "path": student,
            "init": "random",
            "seed": 2 + i,
            "name": mode,
            "loss": mode,
            "overrides": TINY,
            "tp": teacher_tp,
            "projection": projection if mode in ("xtoken", "gold") else None,
        }
        for i, mode in enumerate(MODES)
    ]
    d = {
        "name": Path(run_dir).name,
        "run_dir": run_dir,
        "steps": steps,
        "seed": 0,
        "device": "cpu",
        "model": {"path": student, "init": "random", "seed": 1, "overrides": TINY},
        "teachers": teachers,
        "loss": {"mode": "kd_topk", "ce_weight": 1.0, "kd_weight": 0.5},
        "data": {
            "shards": shards,
            "micro_batch_size": layout.pop("mb", 2),
            "grad_accum": grad_accum,
            "shuffle_buffer": 0,  # file order: every layout sees the same global batch
            "max_student_tokens": 64,
            "eval_fraction": 0.1,
        },
        "optim": {"lr": 1e-2, "warmup_steps": 0, "grad_clip": 1.0},
        "parallel": {"teacher_placement": "inprocess", **layout},
        "checkpoint": {"resume": "auto", "save_at_end": False, "export_at_end": False},
        "eval": {"max_texts": 2, "teacher": teacher_bpb},
        "logging": {"jsonl": True, "tensorboard": False, "progress": False, "report": False},
        **top,
    }
    return from_dictconfig(d)


def attach_probes(trainer: Trainer, record: list[dict]) -> None:
    """Per training forward: T, the logits' local shape and placement, the decoder layers'
    activation length, and the widest module output (local tensors)."""
    model = trainer.model
    vocab = trainer.vocab_V
    state: dict = {"wide": []}

    def any_full_vocab(module, inputs, out):
        if not model.training:
            return
        for o in out if isinstance(out, tuple) else (out,):
            local = o.to_local() if isinstance(o, DTensor) else o
            if isinstance(local, torch.Tensor) and local.dim() and local.shape[-1] == vocab:
                state["wide"].append(type(module).__name__)

    def layer_length(module, inputs, out):
        if model.training:
            hidden = out[0] if isinstance(out, tuple) else out
            state["layer_len"] = int(hidden.shape[1])

    for m in model.modules():
        m.register_forward_hook(any_full_vocab)
    parallelize.decoder_layers(model)[0].register_forward_hook(layer_length)
    head = model.get_output_embeddings()
    head.register_forward_hook(
        lambda m, i, out: state.update(
            placement=[str(p) for p in out.placements] if isinstance(out, DTensor) else None
        )
    )
    # the rows each of this rank's teachers computes per microbatch (a cp rank: its share)
    state["teacher_rows"] = []
    for source in trainer.channels:
        channel = getattr(source, "source", source).channel
        submit = channel.submit

        def counted(inputs, submit=submit):
            state["teacher_rows"].append(int(inputs["input_ids"].shape[0]))
            return submit(inputs)

        channel.submit = counted
    forward = trainer.shards.forward

    def probed(mb):
        state["wide"] = []
        logits = forward(mb)
        record.append(
            {
                "T": int(mb.input_ids_BT.shape[1]),
                "logits_local": list(logits.shape),
                "placement": state.get("placement"),
                "layer_len": state.get("layer_len"),
                "full_vocab_outputs": sorted(set(state["wide"])),
                "teacher_rows": sorted(set(state["teacher_rows"])),
                "vocab": vocab,
            }
        )
        return logits

    trainer.shards.forward = probed  # the shard batches' student forward (`ShardSource`)


def run(cfg, out: Path, *, probe: bool = False) -> None:
    """What trainer/main.py does with a validated config, plus the probes."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(cfg, preflight(cfg, world_size=world))
    record: list[dict] = []
    if probe:
        attach_probes(trainer, record)
    try:
        trainer.train()
    finally:
        trainer.close()
    if probe:
        folder = out / Path(cfg.run_dir).name / "probes"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{dist.get_rank()}.json"
        earlier = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(earlier + record))


def runs(which: str) -> dict[str, dict]:
    """Run name -> {layout, probe, resume}; one process for ``ref``, 2 for ``two``, 4 for
    ``four``."""
    if which == "ref":
        # ref: the student's logits projected block by block (parallel.logits_chunk, the
        # default); ref_whole: the same run with the whole [B, T, V] logits
        # ref3: the uninterrupted reference of `resize` (3 steps)
        return {
            "ref": {"layout": {"teacher_bpb": True}},
            "ref_whole": {"layout": {"logits_chunk": 0}},
            "ref3": {"layout": {"steps": 3}},
        }
    if which == "two":
        return {
            "tp2": {"layout": {"tp": 2}, "probe": True},  # teachers at tp=1
            "cp2": {"layout": {"cp": 2}, "probe": True},  # teachers whole (cp=1)
            "dp2": {"layout": {"dp_shard": 2, "mb": 1}},
            # the reverse of tp2: the student whole, every teacher at tp=2 (top-k, columns,
            # sorted rest and target log-probs from vocab-sharded teacher logits)
            # (and their reference BPB, every teacher built sharded over its TP group)
            "dp2_teacher_tp2": {
                "layout": {"dp_shard": 2, "mb": 1, "teacher_tp": 2, "teacher_bpb": True}
            },
        }
    if which == "four":
        # step 1, a checkpoint, then step 2 by a fresh Trainer that resumed from it
        # HSDP: weights sharded over 2 ranks, replicated twice (4 dp ranks, one row each)
        return {
            "cp2_tp2": {"layout": {"cp": 2, "tp": 2}, "probe": True, "resume": True},
            "hsdp2x2": {"layout": {"dp_replicate": 2, "dp_shard": 2, "mb": 1, "ga": 1}},
        }
    raise ValueError(f"unknown set {which!r}")


def _tiny(kind: str):
    """A tiny tied-embedding Llama, or a Gemma 3 whose layers alternate sliding (window 5) and
    full attention, softcapped logits and a scaled embedding: the model-level parts."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    torch.manual_seed(0)
    shape = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "head_dim": 8}
    shape.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "llama":
        cfg = LlamaConfig(tie_word_embeddings=True, initializer_range=0.2, **shape)
    else:
        layers = ["sliding_attention", "full_attention"]
        cfg = Gemma3TextConfig(sliding_window=5, layer_types=layers, **shape)
        cfg.final_logit_softcapping = 5.0
    return AutoModelForCausalLM.from_config(cfg)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def model_checks() -> dict:
    """cp = 2 and tp = 2 forwards + backwards of tiny Llama and Gemma 3 models against the whole
    model in this process: max |difference| / max |reference| of the logits and of every
    parameter's gradient."""
    from tokenbridge.dist_ops import to_cp_layout
    from tokenbridge.dist_ops.dtensor import unwrap_vocab_sharded
    from trainer.data.microbatches import Microbatch
    from trainer.parallel.cp_attention import model_inputs
    from trainer.parallel.mesh import build_mesh

    ids_BT = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    w_BTV = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(4))
    mb = Microbatch(ids_BT, torch.ones_like(ids_BT), ids_BT)
    out = {}
    for kind in ("llama", "gemma3"):
        ref = _tiny(kind)
        logits_BTV = ref(input_ids=ids_BT, use_cache=False).logits
        (logits_BTV * w_BTV).sum().backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        # cp = 2: each rank its positions; the objective is the sum of the ranks' terms
        groups = build_mesh(torch.device("cpu"), dp=1, cp=2, tp=1)
        model = _tiny(kind)
        parallelize.apply_cp(model, 2)
        rows = mb.student_rows(cp_size=2, cp_rank=groups.cp_rank)
        kw = model_inputs(rows, group=groups.cp)
        local = model(**kw, use_cache=False).logits
        w_local = to_cp_layout(w_BTV, cp_size=2, cp_rank=groups.cp_rank)
        (local * w_local).sum().backward()
        diff = {
            "logits": float(
                (local - to_cp_layout(logits_BTV, cp_size=2, cp_rank=groups.cp_rank)).abs().max()
            )
        }
        for n, p in model.named_parameters():
            dist.all_reduce(p.grad, group=groups.cp)
            diff[n] = _rel(p.grad, want[n])
        out[f"{kind}_cp2"] = diff
        # tp = 2: vocab-sharded logits (DTensor), tied embedding gradient gathered
        groups = build_mesh(torch.device("cpu"), dp=1, cp=1, tp=2)
        model = _tiny(kind)
        plan = parallelize.tp_plan(model.config.model_type)
        names = parallelize.apply_tp(model, groups.tp_mesh, plan)
        logits = model(input_ids=ids_BT, use_cache=False).logits
        local, _ = unwrap_vocab_sharded(logits)
        v0 = groups.tp_rank * local.shape[-1]
        # the sum over the tp ranks of their columns' terms is the whole objective
        (local * w_BTV[..., v0 : v0 + local.shape[-1]]).sum().backward()
        parallelize.sync_replicated_grads(model, names, groups.tp)
        diff = {"logits": _rel(logits.full_tensor(), logits_BTV)}
        diff["tied"] = float(model.lm_head.weight is model.model.embed_tokens.weight)
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            diff[n] = _rel(g, want[n])
        out[f"{kind}_tp2"] = diff
    return out


def weights_checks(layouts: dict[str, dict]) -> dict[str, bool]:
    """Per layout name ({"dp": , "tp": }): the student (FSDP over dp, TP over tp) and a teacher
    (TP over tp) built on the meta device and filled shard by shard, gathered, equal to
    `build_model`'s weights bit for bit: SmolLM2- and Gemma 3-shaped random inits."""
    from tokenbridge import models
    from trainer.checkpoint.checkpointer import full_model_state_dict
    from trainer.config.precision import Precision
    from trainer.config.sections import ModelConfig, ParallelConfig, TeacherConfig
    from trainer.parallel.mesh import build_mesh
    from trainer.parallel.sharded_build import build_student, build_teacher

    gemma = {**TINY, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 32}
    sources = {
        "smollm2": (str(paths.student_dir()), TINY),
        "gemma3": (str(paths.teacher_dir()), gemma),
    }
    fp32 = Precision(device="cpu", param_dtype="float32", reduce_dtype="float32",
                     teacher_dtypes=(), fused_optimizer=True)  # fmt: skip
    out = {}
    for name, (path, over) in sources.items():
        want = models.build_model(ModelConfig(path=path, init="random", seed=5, overrides=over))
        want = want.state_dict()
        for label, lay in layouts.items():
            rep = lay.get("rep", 1)
            mesh = build_mesh(torch.device("cpu"), dp=lay["dp"], tp=lay["tp"], replicate=rep)
            cfg = ModelConfig(path=path, init="random", seed=5, overrides=over)
            model, _ = build_student(cfg, mesh=mesh, parallel=ParallelConfig(tp=lay["tp"]),
                                     precision=fp32, device=torch.device("cpu"))  # fmt: skip
            got = full_model_state_dict(model)
            if rep > 1:  # HSDP: every weight replicated over dim 0, sharded over dim 1
                placements = {str(p.placements) for p in model.parameters()}
                out[f"{name}_hsdp_placements"] = placements == {"(Replicate(), Shard(dim=0))"}
            out[f"{name}_student_{label}"] = dist.get_rank() != 0 or all(
                torch.equal(got[k], want[k]) for k in want
            )
            teacher = build_teacher(TeacherConfig(path=path, init="random", seed=5, overrides=over),
                                    dtype="float32", device=torch.device("cpu"),
                                    tp_mesh=mesh.tp_mesh)  # fmt: skip
            full = {k: v.full_tensor() if isinstance(v, DTensor) else v
                    for k, v in teacher.state_dict().items()}  # fmt: skip
            out[f"{name}_teacher_{label}"] = all(torch.equal(full[k], want[k]) for k in want)
        # pretrained: the same weights written as a HF directory, read back by slices under TP
        saved = Path(tempfile.gettempdir()) / f"tb-weights-{os.getppid()}-{name}"
        if dist.get_rank() == 0:
            models.export_hf(want, cfg=ModelConfig(path=path, init="random", overrides=over),
                             out_dir=saved)  # fmt: skip
        dist.barrier()
        for label, lay in layouts.items():
            mesh = build_mesh(torch.device("cpu"), dp=lay["dp"] * lay.get("rep", 1), tp=lay["tp"])
            teacher = build_teacher(TeacherConfig(path=str(saved)), dtype="float32",
                                    device=torch.device("cpu"), tp_mesh=mesh.tp_mesh)  # fmt: skip
            full = {k: v.full_tensor() if isinstance(v, DTensor) else v
                    for k, v in teacher.state_dict().items()}  # fmt: skip
            ok = all(torch.equal(full[k], want[k]) for k in want)
            out[f"{name}_pretrained_teacher_{label}"] = ok
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(saved)
    return out


def resize(shards: str, projection: str, out: Path, *, part: str) -> None:
    """`resize`: part ``a`` (2 processes) runs step 1, ``b`` (1) step 2, ``c`` (2) step 3; each
    resumes the checkpoint the part before saved, on another world size."""
    run_dir = str(out / "resize")
    ck = {"resume": "auto", "save_at_end": True, "export_at_end": part == "c"}
    layout = {"steps": 3, **({"mb": 2} if part == "b" else {"dp_shard": 2, "mb": 1})}
    cfg = make_cfg(shards, projection, run_dir, layout=layout, checkpoint=ck)
    cfg.stop_after = {"a": 1, "b": 2, "c": None}[part]
    run(cfg, out)


def _one_process(*args: str) -> None:
    """This script as one process of its own (not a member of the launch's process group)."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and "TORCHELASTIC" not in k}
    # launched by the tests' zygote (its shims' server in the environment): the process is forked
    # from it through the shim, as fresh a process without its ~8 s of imports
    shim = [str(SHIM)] if env.get(SHIM_SOCKET) else []
    proc = subprocess.run([sys.executable, *shim, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{args[0]}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def main(which: str, shards: str, projection: str, out_dir: str) -> None:
    out = Path(out_dir)
    torch.set_num_threads(1)
    parallelize.init_distributed(torch.device("cpu"))
    if which == "one":
        resize(shards, projection, out, part="b")
        dist.destroy_process_group()
        return
    if which == "two":
        checks = model_checks()
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "model_checks.json").write_text(json.dumps(checks, indent=1))
    if which in ("two", "four"):
        layouts = (
            {"dp2": {"dp": 2, "tp": 1}, "tp2": {"dp": 1, "tp": 2}}
            if which == "two"
            else {"dp2_tp2": {"dp": 2, "tp": 2}, "hsdp2x2": {"dp": 2, "tp": 1, "rep": 2}}
        )
        checks = weights_checks(layouts)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, checks)
        if dist.get_rank() == 0:
            merged = {k: all(g[k] for g in gathered) for k in checks}
            (out / f"weights_{which}.json").write_text(json.dumps(merged, indent=1))
    for name, spec in runs(which).items():
        run_dir = str(out / name)
        layout = dict(spec.get("layout", {}))
        probe = spec.get("probe", False)
        if spec.get("resume"):
            # stopped after step 1 with a checkpoint, then resumed by a fresh Trainer; the
            # resumed run exports the student at its end (tied embeddings under TP included)
            ck = {"resume": "auto", "save_at_end": True, "export_at_end": True}
            first = make_cfg(shards, projection, run_dir, layout=dict(layout), checkpoint=ck)
            first.stop_after = 1
            run(first, out, probe=probe)
            run(
                make_cfg(shards, projection, run_dir, layout=layout, checkpoint=ck),
                out,
                probe=probe,
            )
        else:
            cfg = make_cfg(shards, projection, run_dir, layout=layout)
            run(cfg, out, probe=probe)
    if which == "two":  # 2 processes, then 1 (started by rank 0), then 2 again
        resize(shards, projection, out, part="a")
        if dist.get_rank() == 0:
            _one_process("one", shards, projection, out_dir)
        dist.barrier()
        resize(shards, projection, out, part="c")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
