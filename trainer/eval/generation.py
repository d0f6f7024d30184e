"""Optional generation tasks: greedy decoding, answer extraction, sandboxed code execution.

HumanEval's code runs in a separate, limited process: that contains runaway or crashing code,
not a malicious program, so generation is opt-in and meant for models you trust (docs/eval.md,
"Benchmarks").

Tensor legend: B prompts in a batch, T positions, V vocabulary.
"""

from __future__ import annotations

import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm.auto import tqdm

from trainer.eval.loglik import TextEncoder, forward_checked, model_device

HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stop if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def greedy_generate(
    model,
    enc: TextEncoder,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stop: list[str],
    batch_size: int = 8,
    progress: bool | str = False,
) -> list[str]:
    """Greedy continuations of token prompts, cut at the first stop string or EOS."""
    if enc.decode is None:
        raise ValueError("generation needs a tokenizer that can decode")
    device = model_device(model)
    out: list[str] = [""] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    bar = tqdm(
        total=len(prompts),
        desc=progress if isinstance(progress, str) else "generate",
        disable=not progress,
        leave=False,
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                texts = _generate_batch(
                    model,
                    enc,
                    [prompts[i] for i in batch],
                    device=device,
                    max_new_tokens=max_new_tokens,
                    stop=stop,
                )
                for i, t in zip(batch, texts):
                    out[i] = t
                bar.update(len(batch))
    finally:
        model.train(was_training)
        bar.close()
    return out


def _generate_batch(model, enc, prompts, *, device, max_new_tokens, stop) -> list[str]:
    n, lp = len(prompts), max(len(p) for p in prompts)
    ids_BT = torch.zeros(n, lp, dtype=torch.long)
    mask_BT = torch.zeros(n, lp, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's next token lands in one column
        ids_BT[b, lp - len(p) :] = torch.tensor(p)
        mask_BT[b, lp - len(p) :] = 1
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    ids_BT, mask_BT, pos_BT = ids_BT.to(device), mask_BT.to(device), pos_BT.to(device)
    out = forward_checked(
        model, input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, logits_to_keep=1
    )
    cache, pos_B1 = out.past_key_values, pos_BT[:, -1:]
    generated: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_new_tokens):
        next_B = out.logits[:, -1, : enc.vocab_size].argmax(-1)
        for b, tok in enumerate(next_B.tolist()):
            if done[b]:
                continue
            if tok == enc.eos_id:
                done[b] = True
                continue
            generated[b].append(tok)
            done[b] = _cut(enc.decode(generated[b][-64:]), stop)[1]
        if all(done):
            break
        mask_BT = torch.cat([mask_BT, torch.ones(n, 1, dtype=torch.long, device=device)], 1)
        pos_B1 = pos_B1 + 1
        out = forward_checked(
            model,
            input_ids=next_B[:, None],
            attention_mask=mask_BT,
            position_ids=pos_B1,
            past_key_values=cache,
            logits_to_keep=1,
        )
        cache = out.past_key_values
    return [_cut(enc.decode(g), stop)[0] for g in generated]


# ---------------------------------------------------------------- answers

_NUMBER = r"-?[\d,]*\.?\d+"


def extract_gsm8k(text: str) -> str | None:
    m = re.search(r"answer is\s*\$?\s*(" + _NUMBER + ")", text)
    if m:
        return m.group(1)
    nums = re.findall(_NUMBER, text)
    return nums[-1] if nums else None


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_math(text: str) -> str | None:
    m = re.search(r"final answer is\s*\$(.+?)\$", text)
    return m.group(1) if m else last_boxed(text)


def normalize_answer(s: str) -> str:
    s = s.strip().strip("$").strip()
    for old, new in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("dfrac", "frac"),
        ("tfrac", "frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", ""),
        ("%", ""),
        ("\\$", ""),
        (",\\!", ""),
        (" ", ""),
    ]:
        s = s.replace(old, new)
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?[\d,]+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def answers_match(pred: str | None, ref: str | None) -> bool:
    if pred is None or ref is None:
        return False
    p, r = normalize_answer(pred), normalize_answer(ref)
    if p == r:
        return True
    try:
        return math.isclose(float(p), float(r), rel_tol=1e-6, abs_tol=1e-9)
    except ValueError:
        return False


# ---------------------------------------------------------------- code execution


def _limits(cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_sandboxed(program: str, *, timeout: float = 5.0) -> tuple[bool, str]:
    """Run ``program`` in a throw-away interpreter; (exit code 0, last stderr or reason)."""
    with tempfile.TemporaryDirectory(prefix="tb-exec-") as tmp:
        path = Path(tmp) / "program.py"
        path.write_text(program)
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", str(path)],
            cwd=tmp,
            env={"PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group, killed as a whole below
            preexec_fn=lambda: _limits(int(math.ceil(timeout)) + 1),
        )
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return False, f"timeout after {timeout:g} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode == 0, err.decode("utf-8", "replace")[-300:]


def humaneval_program(prompt: str, completion: str, *, test: str, entry_point: str) -> str:
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
