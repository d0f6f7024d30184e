"""On-policy distillation on CPU: our sampler vs HF `generate`, FSDP2 gathering for generation,
the on-policy step's phases, and TRL's GOLD trainer next to ours.

Each part's result is stored as it ends, so a later part that fails loses nothing
(``ONPOLICY_RESUME=1`` reuses those of the same clean commit);
``python -m bench.onpolicy.section sampler`` runs part 1 alone and prints its table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import torch

from tokenbridge import paths
from trainer.onpolicy.sampling.decode import int8_weights
from trainer.onpolicy.sampling.int8 import int8_available

B, PROMPT, NEW = 8, 16, 32
SAMPLER_BATCHES = (2, 8)  # SmolLM2-135M: the batch 2, and 8
REPS = 3
# a tiny random model, where the step's overhead, not reading the weights, dominates
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def _median_runs(fns: dict, *, reps: int = REPS) -> dict[str, float]:
    """Median seconds of each callable, run in turn (one warm-up round first)."""
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def read_weights(model):
    """A callable that reads every parameter once (a sum each): a decode step's memory floor,
    since a step reads all the weights at least once."""
    params = [p.detach() for p in model.parameters()]
    device = params[0].device

    def read():
        total = torch.zeros((), device=device, dtype=torch.float64)
        for p in params:
            total += p.sum()
        return float(total)  # one sync at the end (CUDA)

    return read


def sampler_vs_generate(
    model, prompts, vocab: int, *, new: int = NEW, reps: int = REPS, top_p: float = 0.9
) -> dict:
    """Our sampler (lean path and HF-forward path) and HF `generate` on the same model (on its
    device) and prompts, exactly `new` tokens each, and the time to read the weights once:
    tokens/s, ms per token step (prefill included) and the floor (the GPU is synchronised
    before a clock is read)."""
    from trainer.onpolicy.sampling.sampler import SamplingConfig, _left_pad, sample

    device = next(model.parameters()).device
    ids, mask = _left_pad(prompts, device)
    cfg = SamplingConfig(temperature=1.0, top_p=top_p, max_new_tokens=new)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ours(lean: bool = True, weights: str = "model", int8=None):
        sample(model, prompts, config=replace(cfg, weights=weights),
               seeds=list(range(len(prompts))), stop_ids=[], vocab_size=vocab, lean=lean,
               int8=int8)  # fmt: skip
        sync()

    def theirs():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_p=top_p,
                           top_k=0, temperature=1.0, max_new_tokens=new, min_new_tokens=new,
                           pad_token_id=0)  # fmt: skip
        sync()

    fns = {"ours": ours, "hf": theirs, "hf_path": lambda: ours(False), "floor": read_weights(model)}
    copy_s = None
    if device.type == "cpu" and int8_available():
        # the int8 copy made per rollout (onpolicy.sampler_refresh=1), and made once, before
        fns["int8"] = lambda: ours(weights="int8")
        t0 = time.perf_counter()
        copy = int8_weights(model, vocab_size=vocab)
        copy_s = time.perf_counter() - t0
        fns["int8_reused"] = lambda: ours(weights="int8", int8=copy)
    t = _median_runs(fns, reps=reps)
    tokens = len(prompts) * new
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "ours_tok_s": tokens / t["ours"], "hf_tok_s": tokens / t["hf"],
        "speedup": t["hf"] / t["ours"],
        "ours_step_ms": t["ours"] / new * 1e3, "hf_step_ms": t["hf"] / new * 1e3,
        "hf_path_step_ms": t["hf_path"] / new * 1e3, "floor_ms": t["floor"] * 1e3,
        "over_floor": t["ours"] / new / t["floor"], "weight_mb": weights / 1e6,
        "bandwidth_gb_s": weights / t["floor"] / 1e9, "rows": len(prompts),
        "int8_step_ms": t["int8"] / new * 1e3 if "int8" in t else None,
        "int8_reused_step_ms": t["int8_reused"] / new * 1e3 if "int8" in t else None,
        "int8_copy_s": copy_s,
    }  # fmt: skip


def part_sampler() -> dict:
    from tokenbridge import models
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig

    torch.set_num_threads(1)
    tok = load_tokenizer(paths.student_dir())
    from bench.onpolicy.prompt_texts import prompts_from_kjv

    res = {}
    for name, cfg, batches in (
        ("smollm2-135m", ModelConfig(str(paths.student_dir())), SAMPLER_BATCHES),
        (
            "tiny (SmolLM2 vocab)",
            ModelConfig(str(paths.student_dir()), init="random", overrides=TINY),
            (B,),
        ),
    ):
        model = models.build_model(cfg).eval()
        for rows in batches:
            prompts = prompts_from_kjv(tok, rows, PROMPT)
            res[f"{name}, batch {rows}"] = sampler_vs_generate(model, prompts, tok.vocab_size)
        del model
    # the form of each product the lean step measured (`trainer.onpolicy.sampling.orient`), for the
    # real model's shapes: (rows, N, K) -> weight-major faster
    from trainer.onpolicy.sampling import orient

    res["forms"] = {f"{k[0]},{k[1]},{k[2]}": v for k, v in orient.choices().items()
                    if k[3] == torch.float32 and k[2] == 576}  # fmt: skip
    return res


def part_fsdp() -> dict:
    out = paths.REPO_ROOT / "outputs" / "bench" / "onpolicy_fsdp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(paths.REPO_ROOT / "bench/onpolicy/fsdp_gather.py"), str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, cwd=paths.REPO_ROOT, check=True, timeout=1800, env=env)
    return json.loads(out.read_text())


def part_step() -> dict:
    from bench.onpolicy.step_phases import step_breakdown

    return step_breakdown()


def part_trl() -> dict:
    from bench.onpolicy.vs_trl import measure

    return measure([64, 128], steps=5)


PARTS = {"sampler": part_sampler, "fsdp": part_fsdp, "step": part_step, "trl": part_trl}
PARTS_DIR = paths.REPO_ROOT / "outputs" / "bench" / "onpolicy_parts"


def run_part(name: str, *, resume: bool) -> dict:
    """One part, its result stored the moment it ends (a later part that fails loses nothing).
    ``resume`` (``ONPOLICY_RESUME=1``): a part already stored from this same clean commit is
    read back, said so, instead of measured again."""
    from bench import provenance

    path, commit = PARTS_DIR / f"{name}.json", provenance.commit()
    if resume and path.is_file() and "dirty" not in commit:
        saved = json.loads(path.read_text())
        if saved["commit"] == commit:
            print(f"onpolicy part {name}: reusing its result from {saved['at']} (commit {commit})")
            return saved["result"]
    result = PARTS[name]()
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    at = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"commit": commit, "at": at, "result": result}, indent=2))
    os.replace(tmp, path)
    return result


def main() -> str:
    resume = os.environ.get("ONPOLICY_RESUME") == "1"
    res = {name: run_part(name, resume=resume) for name in PARTS}
    raw = paths.REPO_ROOT / "outputs" / "bench" / "onpolicy.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(res, indent=2))
    return render(res)


def render_sampler(sampler: dict) -> list[str]:
    lines = [
        f"**Sampler vs HF `generate`**: {PROMPT}-token KJV prompts, exactly {NEW} new tokens, "
        "temperature 1, top-p 0.9, one thread, median of 3 alternating runs. ms per token step "
        "= a rollout's seconds / new tokens (the prefill included). Floor: reading every weight "
        "once (a sum over each parameter, in the same run), the least a decode step can take.",
        "",
        "| model | ours ms/step | ours, HF forward | HF generate | floor ms | ours / floor | "
        "speed-up vs generate | ours tokens/s | int8 copy, made per rollout: ms/step | "
        "int8 copy made once: ms/step | making the copy s | int8 copy made once: speed-up vs "
        "generate, over floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    forms = sampler.get("forms", {})
    for name, r in sampler.items():
        if name == "forms":
            continue
        q, q1 = r.get("int8_step_ms"), r.get("int8_reused_step_ms")
        int8 = (
            f"{q:.1f} | {q1:.1f} | {r['int8_copy_s']:.2f} | {r['hf_step_ms'] / q1:.2f}x, "
            f"{q1 / r['floor_ms']:.2f}x"
            if q
            else "not run | not run | - | -"
        )
        lines.append(
            f"| {name} | {r['ours_step_ms']:.1f} | {r['hf_path_step_ms']:.1f} | "
            f"{r['hf_step_ms']:.1f} | {r['floor_ms']:.1f} ({r['weight_mb']:.0f} MB at "
            f"{r['bandwidth_gb_s']:.0f} GB/s) | {r['over_floor']:.2f}x | {r['speedup']:.2f}x | "
            f"{r['ours_tok_s']:.1f} | {int8} |"
        )
    lines += ["", "The int8 copy (`onpolicy.sampler_weights: int8`) samples from another "
              "distribution than the model's; a run weights its loss by the likelihood ratio "
              "(docs/onpolicy.md). Made per rollout, its time includes making the copy; a run "
              "makes one every `onpolicy.sampler_refresh` rollout phases. The floor is fp32's "
              "(the int8 copy reads a quarter of those bytes)."]  # fmt: skip
    if forms:  # SmolLM2's products at 2 rows, as this process measured them (`orient`)
        two = sorted((k, v) for k, v in forms.items() if k.startswith("2,"))
        named = ", ".join(f"{k.split(',', 1)[1].replace(',', 'x')}: "
                          f"{'weight-major' if v else 'F.linear'}" for k, v in two)  # fmt: skip
        lines += ["", "The form of each product of SmolLM2-135M's lean decode step at 2 rows, "
                  f"as this machine measured it (N x K; `trainer/onpolicy/sampling/orient.py`): {named}."]  # fmt: skip
    return lines


def render(res: dict) -> str:
    from bench.onpolicy.step_phases import render_step
    from bench.onpolicy.vs_trl import render as render_trl

    lines = ["## On-policy distillation (CPU)", "", *render_sampler(res["sampler"])]
    f = res["fsdp"]
    lines += [
        "",
        f"**FSDP2 generation** (2 gloo ranks, {f['model']}, {f['rows']} rows x {f['new']} new "
        "tokens per rank): parameter all-gathers and seconds per rollout phase.",
        "",
        "| | all-gathers | seconds |",
        "|---|---:|---:|",
        f"| per token (FSDP's default) | {f['plain_gathers']} | {f['plain_s']:.2f} |",
        f"| gathered once (`sampler.gathered`) | {f['gathered_gathers']} | {f['gathered_s']:.2f} |",
        "",
    ]
    lines += render_step(res["step"])
    lines += render_trl(res["trl"])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # `python -m bench.onpolicy.section sampler`: part 1 alone, its table printed (BENCHMARKS.md
    # is written by `make bench` only)
    if sys.argv[1:] == ["sampler"]:
        print("\n".join(render_sampler(part_sampler())))
    else:
        raise SystemExit("usage: python -m bench.onpolicy.section sampler")
