"""`make gpu-check`'s shared ground (sizes, context, clocks, memory, time limits) and three of its
parts: the CUDA-marked tests, our sampler vs HF `generate`, the teacher program vs a bare forward.

Models are random-init from the shipped config.json files (no weights travel), each with its
real tokenizer. Legend: B rows, U teacher positions.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from tokenbridge import paths

REPO = paths.REPO_ROOT
# the teacher-cache job's defaults: rows x positions per lm_head application
# (pipelines.teacher_cache.handler.ROWS_PER_HEAD), padded tokens per forward (JobConfig) and k;
# those modules import Beam, which a GPU image lacks (a test keeps these equal to them)
CACHE_ROWS_PER_HEAD = 256
CACHE_BATCH_TOKENS = 8192
CACHE_K = 32


@dataclass(frozen=True)
class Sizes:
    """Every size a part uses: rows, lengths, steps (``warmup`` steps are dropped)."""

    demo_len: int  # part 2: student tokens per row
    demo_rows: int  # rows per microbatch
    scale_len: int  # part 3
    scale_rows: int
    long_len: int  # part 4: the one long row
    logits_chunk: int  # part 4: positions per lm_head chunk
    warmup: int
    steps: int
    sample_rows: int  # part 5
    sample_prompt: int
    sample_new: int
    fwd_len: int  # part 6: teacher tokens per row (rows: the cache job's batch of tokens)
    reps: int  # timed repetitions of part 6 (after one warm-up); part 5 times one
    text_chars: int  # of the shipped corpus, for the shards and prompts
    # the "1B student / 4B teacher" shapes (config.json overrides, init=random)
    student_1b: dict
    teacher_4b: dict


GPU = Sizes(
    demo_len=2048, demo_rows=4, scale_len=4096, scale_rows=2, long_len=32768, logits_chunk=256,
    warmup=2, steps=4, sample_rows=32, sample_prompt=64, sample_new=256, fwd_len=2048, reps=3,
    text_chars=300_000,
    student_1b={"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64,
                "max_position_embeddings": 32768},
    teacher_4b={"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
)  # fmt: skip
DRY = Sizes(
    demo_len=64, demo_rows=2, scale_len=96, scale_rows=1, long_len=256, logits_chunk=64,
    warmup=1, steps=1, sample_rows=2, sample_prompt=8, sample_new=8, fwd_len=64,
    reps=1, text_chars=12_000,
    student_1b={"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16},
    teacher_4b={"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 4,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16},
)  # fmt: skip


@dataclass
class Context:
    """One run of the check: where it runs, its sizes and scratch space."""

    dry: bool
    device: torch.device
    sizes: Sizes
    tmp: Path
    out: Path
    compile: bool = False  # part 3 with parallel.compile (off: the first step would pay it)
    cache: dict = dataclasses.field(default_factory=dict)  # shards and text, built once

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


# ---------------------------------------------------------------------------------------------
# time limits, clocks and memory


class PartTimeout(BaseException):
    """A part ran past its budget (a BaseException: no ``except Exception`` swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float, *, again_s: float = 20.0):
    """Raise `PartTimeout` in this (the main) thread once `seconds` have passed, and once more
    `again_s` later: an exception raised inside a finalizer (``__del__``, a weakref callback) is
    printed and dropped by Python, so the first may be lost."""

    def expire(signum, frame):
        signal.setitimer(signal.ITIMER_REAL, again_s)
        raise PartTimeout(f"ran past its budget of {seconds:.0f} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


@contextlib.contextmanager
def uninterrupted():
    """No time limit inside (closing teacher workers, freeing memory): an expiry waits until
    the block is done."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_s(
    fn: Callable[[], object], *, reps: int, device: torch.device, warmup: bool = True
) -> float:
    """Median seconds of `reps` calls after one warm-up (unless not `warmup`), the device
    synchronised each time."""
    if warmup:
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    """This process's peak: the CUDA allocator's since `reset_peak`, else the RSS peak."""
    from trainer.run_log import peak_memory_gib

    return peak_memory_gib(device)


class PeakMeter:
    """The peak memory of intervals: `read` the interval's peak, then `reset` to start the next.

    A reset whose interval was never read loses that interval's peak (the first GPU run's
    whole-step figure was the memory left after a reset), so it raises. On CPU `reset_peak` does
    nothing, but the calls are checked and counted all the same: the dry run holds the order."""

    def __init__(self, device: torch.device):
        self.device, self.reads, self.resets = device, 0, 0
        self._read = True  # the interval before the first reset is nobody's

    def read(self) -> float:
        self.reads += 1
        self._read = True
        return peak_gib(self.device)

    def reset(self) -> None:
        if not self._read:
            raise RuntimeError(f"peak reset {self.resets + 1} before its interval was read")
        self.resets += 1
        self._read = False
        reset_peak(self.device)


def device_used_gib(device: torch.device) -> float | None:
    """GPU memory in use now by every process (the teacher worker's too); None on CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**30


# ---------------------------------------------------------------------------------------------
# models and text


def tiny_overrides(which: str) -> dict:
    """The shipped tiny shapes: ``student`` (conf/model/smollm2_tiny.yaml) or ``teacher``
    (conf/teachers/gemma3_tiny.yaml)."""
    if which == "student":
        return dict(
            yaml.safe_load((REPO / "conf/model/smollm2_tiny.yaml").read_text())["overrides"]
        )
    doc = yaml.safe_load((REPO / "conf/teachers/gemma3_tiny.yaml").read_text())
    return dict(doc["teachers"][0]["overrides"])


def random_model(ctx: Context, which: str, *, seed: int = 0):
    """The demo pair's student or teacher, random-init (the tiny shape in a dry run), in the
    run's compute dtype, on its device, in eval mode."""
    from tokenbridge import models
    from tokenbridge.model_spec import resolve_dtype

    path = paths.student_dir() if which == "student" else paths.teacher_dir()
    spec = models.ModelSpec(str(path), init="random", seed=seed,
                            overrides=tiny_overrides(which) if ctx.dry else {})  # fmt: skip
    dtype = models.torch_dtype(resolve_dtype("auto", ctx.device))  # the trainer's rule
    return models.build_model(spec, dtype=dtype, device=ctx.device).eval()


def corpus_text(ctx: Context) -> str:
    from bench.common import shakespeare_text

    if "text" not in ctx.cache:
        ctx.cache["text"] = shakespeare_text(ctx.sizes.text_chars)
    return ctx.cache["text"]


# ---------------------------------------------------------------------------------------------
# part 1: the CUDA-marked tests


def _is_cuda_mark(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Attribute) and n.attr == "cuda" and "mark" in ast.unparse(n)
        for n in ast.walk(node)
    )


def cuda_tests() -> list[str]:
    """The node ids of every test marked ``cuda`` (a decorator or a module's ``pytestmark``),
    read with `ast` (nothing imported)."""
    ids = []
    for f in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"))
        whole = any(
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)
            and _is_cuda_mark(n.value)
            for n in tree.body
        )
        for n in tree.body:
            if not (isinstance(n, ast.FunctionDef) and n.name.startswith("test")):
                continue
            if whole or any(_is_cuda_mark(d) for d in n.decorator_list):
                ids.append(f"{f.relative_to(REPO)}::{n.name}")
    return ids


def run_cuda_tests(ctx: Context, *, budget_s: float) -> dict:
    """``pytest -m cuda`` over the files that hold such tests (a dry run lists them). The log
    goes to ``gpu_check_pytest.log`` under the output folder."""
    ids = cuda_tests()
    files = sorted({i.split("::")[0] for i in ids})
    figures: dict = {"tests_marked": len(ids), "files": len(files), "listed": ids}
    if ctx.dry:
        return figures
    # pyproject's addopts already give -q: one more would drop the "N passed in" line
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", *files]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # pytest, its trainer runs and teacher workers
        log, _ = proc.communicate()
        (ctx.out / "gpu_check_pytest.log").write_text(log)
        raise PartTimeout(f"pytest ran past its budget of {budget_s:.0f} s") from None
    (ctx.out / "gpu_check_pytest.log").write_text(log)
    counts = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected)")
    summary = next((ln for ln in reversed(log.splitlines()) if counts.search(ln)), "")
    for n, word in counts.findall(summary):
        figures["error" if word.startswith("error") else word] = int(n)
    if proc.returncode != 0:
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["(no output)"]
        raise RuntimeError(f"pytest -m cuda exited {proc.returncode}: {last[0]}")
    return figures


# ---------------------------------------------------------------------------------------------
# part 5: our sampler vs HF generate


COMPILED_GENERATE_S = 60.0  # what the compiled generate baseline needs left (its compile most)


def sampler_vs_generate(ctx: Context, *, budget_s: float = float("inf")) -> dict:
    """The SmolLM2-shaped student samples the same prompts (exactly `sample_new` tokens each,
    top-p 0.9) with our sampler's default path (on a GPU the static loop, its step one CUDA
    graph: `trainer.onpolicy.sampling.static`), our dynamic loop (rows leave, eager), HF
    `model.generate` as shipped, and `generate` with its static cache compiled
    (``cache_implementation="static"``: transformers then compiles the forward itself, with
    ``torch.compile(mode="reduce-overhead")``, on a GPU only); and the time to read its
    weights once (the floor of a decode step). Each path is warmed up, then timed once, and
    printed as it ends: a run cut at the budget still says which path ran long. The compiled
    baseline runs last and warms up at the timed length (a static cache of another length
    would compile again); on CPU, or with less than `COMPILED_GENERATE_S` left of
    ``budget_s``, it is skipped, with the reason recorded."""
    t_part = time.perf_counter()
    from bench.onpolicy.prompt_texts import prompts_from_lines
    from bench.onpolicy.section import read_weights
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, sample

    s, dev = ctx.sizes, ctx.device
    tok = load_tokenizer(paths.student_dir())
    text = corpus_text(ctx)
    paragraphs = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    prompts = prompts_from_lines(tok, paragraphs, s.sample_rows, s.sample_prompt)
    model = random_model(ctx, "student")
    ids, mask = _left_pad(prompts, dev)

    def ours(new: int, static: bool | None = None) -> None:
        cfg = SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=new)
        sample(model, prompts, config=cfg, seeds=list(range(len(prompts))), stop_ids=[],
               vocab_size=tok.vocab_size, static=static)  # fmt: skip

    @torch.no_grad()
    def generate(new: int, **extra) -> None:
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_p=0.9, top_k=0,
                       temperature=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                       **extra)  # fmt: skip

    floor = read_weights(model)
    floor_s = median_s(floor, reps=5, device=dev)
    out = {"rows": s.sample_rows, "prompt_tokens": s.sample_prompt, "new_tokens": s.sample_new,
           "floor_ms": floor_s * 1e3, "ours_path": "static, CUDA graph" if ctx.gpu else "dynamic"}  # fmt: skip
    paths_ = {
        "ours": (ours, min(8, s.sample_new)),
        "ours_dynamic": (lambda new: ours(new, static=False), min(8, s.sample_new)),
        "hf_generate": (generate, min(8, s.sample_new)),
        "hf_generate_static": (
            lambda new: generate(new, cache_implementation="static"),
            s.sample_new,
        ),
    }
    for name, (fn, warm) in paths_.items():
        left = budget_s - (time.perf_counter() - t_part)
        if name == "hf_generate_static" and (not ctx.gpu or left < COMPILED_GENERATE_S):
            out[f"{name}_skipped"] = (
                f"{left:.0f} s left of the part's budget, {COMPILED_GENERATE_S:.0f} s needed"
                if ctx.gpu else "transformers compiles a static cache's forward on a GPU only"
            )  # fmt: skip
            continue
        try:
            t0 = time.perf_counter()
            fn(warm)  # warm-up: kernels, allocator (and the compile, for the static cache)
            sync(dev)
            out[f"{name}_warmup_s"] = time.perf_counter() - t0
            t = median_s(lambda fn=fn: fn(s.sample_new), reps=1, device=dev, warmup=False)
        except Exception as e:  # a baseline that fails leaves the other figures standing
            if name == "ours":
                raise
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"   {name}: failed: {out[f'{name}_error']}", flush=True)
            continue
        out[f"{name}_tokens_per_s"] = s.sample_rows * s.sample_new / t
        out[f"{name}_step_ms"] = t / s.sample_new * 1e3
        print(f"   {name}: {t:.1f} s for {s.sample_new} tokens x {s.sample_rows} rows", flush=True)
    ratios = {"ours_over_hf": "hf_generate", "ours_over_hf_static": "hf_generate_static",
              "ours_over_dynamic": "ours_dynamic"}  # fmt: skip
    for key, base in ratios.items():  # tokens/s over tokens/s: > 1 is ours faster
        if f"{base}_tokens_per_s" in out:
            out[key] = out["ours_tokens_per_s"] / out[f"{base}_tokens_per_s"]
    out["ours_over_floor"] = out["ours_step_ms"] / out["floor_ms"]
    return out


# ---------------------------------------------------------------------------------------------
# part 6: the teacher program (the cache job's per-position outputs) vs a bare HF forward


def teacher_rows(ctx: Context, *, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, U] teacher ids of the corpus text (consecutive slices, no padding) and their mask."""
    from tokenbridge.tokenizers import load_tokenizer

    if "teacher_ids" not in ctx.cache:
        ctx.cache["teacher_ids"] = load_tokenizer(paths.teacher_dir()).encode(corpus_text(ctx)).ids
    ids, need = ctx.cache["teacher_ids"], rows * length
    if len(ids) < need:
        raise ValueError(f"corpus text gives {len(ids)} teacher tokens, {need} needed")
    ids_BU = torch.as_tensor(ids[:need], dtype=torch.int64).reshape(rows, length).to(ctx.device)
    return ids_BU, torch.ones_like(ids_BU)


def cache_outputs(teacher) -> Callable[[torch.Tensor, torch.Tensor], object]:
    """The teacher-cache job's forward of a [B, U] batch: `teacher_forward` with its outputs
    (top-32 + tail + the realised token's log-prob) and its lm_head chunking."""
    from tokenbridge import models
    from tokenbridge.teacher.forward import teacher_forward
    from tokenbridge.teacher.outputs import TeacherOutputSpec

    spec = TeacherOutputSpec(models.vocab_width(teacher), topk=CACHE_K, target=True)

    @torch.no_grad()
    def forward(ids_BU: torch.Tensor, mask_BU: torch.Tensor):
        chunk = max(1, CACHE_ROWS_PER_HEAD // ids_BU.shape[0])
        return teacher_forward(teacher, ids_BU, mask_BU, spec=spec, columns=None, chunk=chunk)

    return forward


def teacher_program(ctx: Context) -> dict:
    """Part 6: teacher tokens/s of the cache job's forward (`cache_outputs`) next to
    ``model(input_ids).logits`` on the same rows, and the peak memory of each; and the split of
    the program's time: the body and the lm_head's products alone (spans of the program's own
    size, no reductions), so the rest is what the outputs' passes over the vocabulary cost."""
    from tokenbridge import models
    from tokenbridge.teacher.outputs import TeacherOutputSpec, span_rows

    s, dev = ctx.sizes, ctx.device
    rows = max(1, CACHE_BATCH_TOKENS // s.fwd_len) if ctx.gpu else 2
    ids_BU, mask_BU = teacher_rows(ctx, rows=rows, length=s.fwd_len)
    teacher = models.freeze(random_model(ctx, "teacher", seed=2))
    ours = cache_outputs(teacher)
    spec = TeacherOutputSpec(models.vocab_width(teacher), topk=CACHE_K, target=True)
    span = max(span_rows(spec, dev), CACHE_ROWS_PER_HEAD)

    @torch.no_grad()
    def bare():
        return teacher(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False).logits

    @torch.no_grad()
    def products():
        h = teacher.model(input_ids=ids_BU, attention_mask=mask_BU, use_cache=False)
        flat = h.last_hidden_state.reshape(-1, h.last_hidden_state.shape[-1])
        w_VH = teacher.lm_head.weight
        buf = torch.empty(min(span, len(flat)), w_VH.shape[0], device=dev, dtype=w_VH.dtype)
        for r0 in range(0, len(flat), span):
            part = flat[r0 : r0 + span]
            torch.mm(part, w_VH.t(), out=buf[: len(part)])

    out: dict = {"rows": rows, "teacher_tokens_per_row": s.fwd_len, "k": CACHE_K,
                 "span_rows": span}  # fmt: skip
    meter = PeakMeter(dev)
    timed = (("cache_forward", lambda: ours(ids_BU, mask_BU)), ("hf_forward", bare),
             ("products_only", products))  # fmt: skip
    for name, fn in timed:
        sync(dev)
        meter.reset()
        secs = median_s(fn, reps=s.reps, device=dev)
        out[f"{name}_tokens_per_s"] = ids_BU.numel() / secs
        out[f"{name}_peak_gib"] = meter.read()
    out["cache_forward_over_hf"] = (
        out["cache_forward_tokens_per_s"] / out["hf_forward_tokens_per_s"]
    )
    # the share of the program's time its passes over the vocabulary take (>= 0 up to noise)
    out["vocab_passes_share"] = max(
        1e-3, 1 - out["cache_forward_tokens_per_s"] / out["products_only_tokens_per_s"]
    )
    return out
