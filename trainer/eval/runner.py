"""Running tasks on models: ``run_tasks`` (the Python API) and ``evaluate_models`` (the CLI's loop).

``run_tasks(model, tokenizer, tasks, limit=...)`` works on any causal LM already in memory (the
trainer's student included) and returns, per task, its metrics with standard errors, the
per-example samples behind them (for paired comparisons), counters of anything cut or skipped,
and the seconds it took. ``evaluate_models`` loads HF directories one at a time (checking first
that the weights fit in the device's memory), runs the tasks and collects one JSON payload.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import platform
import resource
import time
from pathlib import Path

import numpy as np
import torch

from tokenbridge import model_spec
from trainer.eval import generation
from trainer.eval.bpb import score_texts
from trainer.eval.estimates import summarize
from trainer.eval.loglik import (
    BatchLimits,
    ModelDoesNotFitError,
    ScoreItem,
    TextEncoder,
    TokenStats,
    encode_pair,
    score_items,
    text_encoder,
)
from trainer.eval.results import model_names
from trainer.eval.tasks import Example, Task, load, resolve

LN2 = math.log(2)


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    limit: int | None = None  # stable subset of N examples per task
    batch_size: int = 16  # contexts (examples) per forward
    batch_tokens: int = 2048  # padded tokens per forward
    max_length: int | None = None  # tokens per sequence; None = min(model's, 4096)
    chat: bool = False  # wrap prompts in the tokenizer's chat template
    gen_max_tokens: int = 256
    exec_timeout: float = 5.0
    progress: bool = False

    def __post_init__(self):
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.batch_size < 1 or self.batch_tokens < 1:
            raise ValueError("batch_size and batch_tokens must be >= 1")


def run_tasks(model, tokenizer, tasks, *, limit: int | None = None, **options) -> dict[str, dict]:
    """Evaluate ``model`` on ``tasks`` (names, groups, ``text:PATH``; list or comma string).

    Keyword options are the fields of ``EvalOptions``. Returns task name -> result dict with
    ``kind``, ``primary``, ``n``, ``metrics`` ({name: {value, stderr}}), ``samples``, ``counts``
    and ``seconds``.
    """
    opts = EvalOptions(limit=limit, **options)
    spec = (
        tasks
        if isinstance(tasks, str)
        else ",".join(t.name if isinstance(t, Task) else t for t in tasks)
    )
    cfg = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    max_length = opts.max_length or min(getattr(cfg, "max_position_embeddings", 2048), 4096)
    enc = text_encoder(tokenizer)
    if opts.chat:
        bos = getattr(tokenizer, "bos_token", None)
        if bos and _chat(tokenizer, "x").startswith(bos):  # the template writes BOS itself
            enc = dataclasses.replace(enc, prefix=())
    results = {}
    for task in resolve(spec):
        t0, c0 = time.perf_counter(), time.process_time()
        examples = load(task, limit=opts.limit)
        runner = {"text": _run_text, "gen": _run_gen, "code": _run_gen}.get(task.kind, _run_scored)
        job = _Job(tokenizer, enc, task, examples, opts, max_length)
        samples, counts = runner(model, job)
        results[task.name] = {
            "kind": task.kind,
            "primary": task.primary,
            "n": len(samples["id"]),
            "metrics": summarize(task.kind, samples),
            "counts": counts,
            "seconds": time.perf_counter() - t0,
            "cpu_seconds": time.process_time() - c0,  # all threads; robust to a busy machine
            "samples": samples,
        }
    return results


def _chat(tokenizer, text: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat: this tokenizer has no chat template")
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@dataclasses.dataclass(frozen=True)
class _Job:
    """One task on one model: what every per-kind runner needs."""

    tokenizer: object
    enc: TextEncoder
    task: Task
    examples: list[Example]
    opts: EvalOptions
    max_length: int


def _limits(opts: EvalOptions) -> BatchLimits:
    return BatchLimits(max_items=opts.batch_size, max_tokens=opts.batch_tokens)


def _run_scored(model, job: _Job):
    """mc / lastword / gold_bpb: likelihood of the continuations."""
    tokenizer, enc, task, opts, max_length = (
        job.tokenizer,
        job.enc,
        job.task,
        job.opts,
        job.max_length,
    )
    stats = TokenStats()
    items: list[ScoreItem] = []
    where: list[list[tuple[int, int]] | None] = []
    for ex in job.examples:
        contexts = [_chat(tokenizer, c) for c in ex.contexts] if opts.chat else list(ex.contexts)
        conts = [c.lstrip() for c in ex.continuations] if opts.chat else list(ex.continuations)
        if len(contexts) == 1:
            pairs = [(contexts[0], conts)]
        else:  # partial scoring: the same (or own) continuation after each context
            per = conts if len(conts) == len(contexts) else conts * len(contexts)
            pairs = [(c, [k]) for c, k in zip(contexts, per)]
        encoded = [encode_pair(enc, c, k, max_length=max_length, stats=stats) for c, k in pairs]
        if any(e is None for e in encoded):
            where.append(None)
            continue
        locs = [
            (len(items) + i, k) for i, e in enumerate(encoded) for k in range(len(e.continuations))
        ]
        items += encoded
        where.append(locs)
    scores = score_items(
        model,
        items,
        limits=_limits(opts),
        progress=opts.progress and task.name,
        vocab_size=enc.vocab_size,
    )
    samples: dict[str, list] = {"id": []}
    for ex, locs in zip(job.examples, where):
        if locs is None:
            continue
        choices = [scores[i][k] for i, k in locs]
        cont_ids = [items[i].continuations[k] for i, k in locs]
        row = _sample(task.kind, ex, choices, cont_ids=cont_ids)
        samples["id"].append(ex.id)
        for key, value in row.items():
            samples.setdefault(key, []).append(value)
    return samples, stats.as_dict()


def _sample(kind: str, ex: Example, choices, *, cont_ids) -> dict:
    texts = (
        ex.continuations
        if len(ex.continuations) == len(choices)
        else ex.continuations * len(choices)
    )
    gold = ex.gold if kind == "mc" else 0
    ll = np.array([c.logprob for c in choices])
    row = {
        "bits": -ll[gold] / LN2,
        "bytes": len(texts[gold].encode("utf-8")),
        "tokens": len(cont_ids[gold]),
    }
    if kind == "mc":
        nchar = np.array([max(len(t), 1) for t in texts])
        ntok = np.array([c.num_tokens for c in choices])
        row["acc"] = int(np.argmax(ll) == gold)
        row["acc_norm"] = int(np.argmax(ll / nchar) == gold)  # lm-eval acc_norm, OLMES per-char
        row["acc_per_token"] = int(np.argmax(ll / ntok) == gold)
        row["pred"] = int(np.argmax(ll))
    elif kind == "lastword":
        row["acc"] = int(choices[0].greedy)
    return row


def _run_text(model, job: _Job):
    task, examples, opts = job.task, job.examples, job.opts
    texts = [ex.continuations[0] for ex in examples]
    per = score_texts(
        model,
        job.enc,
        texts,
        max_length=job.max_length,
        limits=_limits(opts),
        progress=opts.progress and task.name,
    )
    samples = {
        "id": [ex.id for ex in examples],
        "bits": [n / LN2 for n in per["nats"]],
        "bytes": per["bytes"],
        "tokens": per["tokens"],
    }
    return samples, {"windows": sum(per["windows"])}


def _run_gen(model, job: _Job):
    tokenizer, enc, task, examples, opts = (
        job.tokenizer,
        job.enc,
        job.task,
        job.examples,
        job.opts,
    )
    keep = max(1, job.max_length - opts.gen_max_tokens)  # prompt tokens, cut from the left
    prompts, truncated = [], 0
    for ex in examples:
        ctx = _chat(tokenizer, ex.contexts[0]) if opts.chat else ex.contexts[0]
        ids = [*enc.prefix, *enc.encode(ctx)]
        truncated += len(ids) > keep
        prompts.append(ids[-keep:])
    stop = generation.HUMANEVAL_STOP if task.kind == "code" else examples[0].extra.get("stop", [])
    outputs = generation.greedy_generate(
        model,
        enc,
        prompts,
        max_new_tokens=opts.gen_max_tokens,
        stop=list(stop),
        batch_size=opts.batch_size,
        progress=opts.progress and task.name,
    )
    samples: dict[str, list] = {"id": [], "em": [], "output": []}
    for ex, out in zip(examples, outputs):
        if task.kind == "code":
            test, entry = ex.extra["test"], ex.extra["entry_point"]
            prog = generation.humaneval_program(ex.contexts[0], out, test=test, entry_point=entry)
            ok = generation.run_sandboxed(prog, timeout=opts.exec_timeout)[0]
        elif task.subset_key == "gsm8k":
            ok = generation.answers_match(generation.extract_gsm8k(out), ex.answer)
        else:  # MATH: reference = last \boxed{} of the gold solution
            ref = generation.last_boxed(ex.extra["doc"].get("solution", "")) or ex.answer
            ok = generation.answers_match(generation.extract_math(out), ref)
        samples["id"].append(ex.id)
        samples["em"].append(int(ok))
        samples["output"].append(out[:500])
    return samples, {"prompt_truncated": truncated}


# ---------------------------------------------------------------- models from directories


def safetensors_params(path: Path) -> int:
    """Parameter count from the safetensors headers (no weights read)."""
    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(int(np.prod(v["shape"])) for k, v in header.items() if k != "__metadata__")
    return total


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(
    path: Path, *, device: torch.device, dtype: torch.dtype, available: int | None = None
) -> int:
    """Raise ``ModelDoesNotFitError`` when the weights (+20% and 512 MiB of working room) exceed
    the free memory of ``device``; return the parameter count."""
    params = safetensors_params(path)
    need = int(params * torch.finfo(dtype).bits // 8 * 1.2) + 2**29
    free = available if available is not None else available_memory(device)
    if need > free:
        raise ModelDoesNotFitError(
            f"{path}: {params / 1e6:.0f}M parameters need ~{need / 2**30:.1f} GiB at {dtype} "
            f"but {free / 2**30:.1f} GiB is free on {device}: try --dtype bfloat16, another "
            "--device, or a smaller model"
        )
    return params


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`tokenbridge.model_spec.resolve_dtype` as a torch dtype (auto: bfloat16 on CUDA)."""
    return getattr(torch, model_spec.resolve_dtype(name, device))


def load_model(path: str | Path, *, device: str = "auto", dtype: str = "auto"):
    """(model, tokenizer, info) from a HF directory, after checking that it fits; its weights
    must match its config exactly (`tokenbridge.models.load_pretrained`): an export missing a
    weight would otherwise be scored with that weight at random."""
    from transformers import AutoTokenizer

    from tokenbridge.models import load_pretrained

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a HF model directory (no config.json)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    params = check_fits(path, device=dev, dtype=dt)
    tokenizer = AutoTokenizer.from_pretrained(path)
    try:
        model = load_pretrained(path, dtype=dt).to(dev).eval()
    except torch.OutOfMemoryError as e:
        raise ModelDoesNotFitError(f"{path}: out of memory while loading on {dev}") from e
    return (
        model,
        tokenizer,
        {
            "path": str(path),
            "device": str(dev),
            "dtype": str(dt).replace("torch.", ""),
            "params": params,
        },
    )


def evaluate_models(
    model_dirs: list[str], tasks: str, *, device: str = "auto", dtype: str = "auto", **options
) -> dict:
    """Load each model in turn, run the tasks, return the JSON payload (models side by side)."""
    names = model_names(model_dirs)
    payload = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tasks": [t.name for t in resolve(tasks)],
        "options": dataclasses.asdict(EvalOptions(**options)),
        "host": {
            "machine": platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "models": {},
    }
    for name, d in zip(names, model_dirs):
        model, tokenizer, info = load_model(d, device=device, dtype=dtype)
        t0 = time.perf_counter()
        info["results"] = run_tasks(model, tokenizer, tasks, **options)
        info["seconds"] = time.perf_counter() - t0
        # the process's peak so far (Linux: KiB); monotone, so a later model's includes earlier
        info["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        payload["models"][name] = info
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return payload
