"""The trainer under TP, CP, DP and TP x CP equals one process, step by step (metrics.jsonl).

Three launches (tests/dist/parallel_trainer_cases.py): the reference in one process, then
tp=2, cp=2, dp=2 and dp=2 with a tp=2 teacher on 2 gloo ranks, then cp=2 x tp=2 on 4 ranks
(stopped after step 1, resumed by a fresh Trainer, exported) and HSDP (dp_replicate=2 x
dp_shard=2: FSDP2's 2-D mesh, 4 data-parallel ranks). Every run distils from four tiny
same-tokenizer teachers, one per loss mode, at the same global batch; each test below reads
one property off the runs' folders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.common import shakespeare_docs
from tests.e2e.helpers import REPO, identity_projection
from tokenbridge.alignment.text_shards import write_text_shards

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "dist" / "parallel_trainer_cases.py"
MODES = ("kd_topk", "xtoken", "gold", "alm")
KEYS = ("loss", "ce", "kd", *(f"kd/{m}" for m in MODES), "grad_norm")
LAYOUTS = ("tp2", "cp2", "dp2", "dp2_teacher_tp2", "cp2_tp2", "hsdp2x2")
REL = 1e-5


def _launch(zygote, which: str, nproc: int, args: list[str]) -> None:
    proc = zygote.run([str(SCRIPT), which, *args], nproc=nproc, timeout=900)
    assert proc.returncode == 0, f"{which}:\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"


@pytest.fixture(scope="module")
def runs(zygote, tmp_path_factory, student_dir) -> Path:
    tmp = tmp_path_factory.mktemp("parallel_trainer")
    shards = write_text_shards(
        tmp / "shards",
        shakespeare_docs(12, chars=600),
        student_dir=student_dir,
        teacher_dirs=[student_dir] * len(MODES),
        max_tokens=64,
    )
    proj = identity_projection(student_dir, tmp / "identity.safetensors")
    out = tmp / "runs"
    args = [str(shards), str(proj), str(out)]
    for which, nproc in (("ref", 1), ("two", 2), ("four", 4)):
        _launch(zygote, which, nproc, args)
    return out


def _records(run: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _probes(run: Path) -> list[dict]:
    return [p for f in sorted((run / "probes").iterdir()) for p in json.loads(f.read_text())]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_gives_the_one_process_losses_and_gradient_norm(runs, layout):
    ref = {r["step"]: r for r in _records(runs / "ref", "train")}
    got = {r["step"]: r for r in _records(runs / layout, "train")}
    assert sorted(got) == sorted(ref) == [1, 2]
    for step, r in got.items():
        assert r["tokens"] == ref[step]["tokens"], (layout, step)
        for k in KEYS:
            assert math.isfinite(r[k]) and r[k] > 0, (layout, step, k, r[k])
            assert r[k] == pytest.approx(ref[step][k], rel=REL), (layout, step, k)
    # the held-out BPB before and after training: whole sequences, gathered logits
    bpb = [r["bpb"] for r in _records(runs / layout, "eval") if "bpb" in r]
    want = [r["bpb"] for r in _records(runs / "ref", "eval") if "bpb" in r]
    assert bpb == pytest.approx(want, rel=REL)


def test_logits_made_whole_give_the_chunked_losses_and_gradient_norm(runs):
    """``parallel.logits_chunk=0`` (the whole [B, T, V] logits) against the default, where every
    loss (CE and the four KD modes) projects the lm_head's input block by block."""
    ref = {r["step"]: r for r in _records(runs / "ref", "train")}
    whole = {r["step"]: r for r in _records(runs / "ref_whole", "train")}
    assert sorted(whole) == sorted(ref) == [1, 2]
    for step, r in whole.items():
        for k in KEYS:
            assert r[k] == pytest.approx(ref[step][k], rel=REL), (step, k)


@pytest.mark.parametrize("layout", ["tp2", "cp2_tp2"])
def test_tp_logits_stay_vocab_sharded_on_every_rank(runs, layout):
    probes = _probes(runs / layout)
    assert len(probes) == 4 * (2 if layout == "tp2" else 4)  # 2 steps x 2 microbatches x ranks
    for p in probes:
        assert p["placement"] == ["S(2)"], p  # Shard(-1) of [B, L, V]
        assert p["logits_local"][-1] == p["vocab"] // 2, p
        # no module of the student produced a [..., V] output in a training forward
        assert p["full_vocab_outputs"] == [], p


@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2"])
def test_cp_activations_hold_half_of_every_sequence(runs, layout):
    for p in _probes(runs / layout):
        assert p["layer_len"] == p["logits_local"][1] == p["T"] // 2, p


@pytest.mark.parametrize("layout", ["tp2", "cp2", "cp2_tp2"])
def test_ranks_sharing_a_microbatch_split_its_teacher_rows(runs, layout):
    """A microbatch has 2 rows, held by every cp and tp rank of a dp group; each of those ranks'
    teachers computes one row (cp2_tp2: ranks 2 and 3 repeat row 1) and the outputs are
    gathered (the losses above equal one process), so no teacher computes the whole batch."""
    for p in _probes(runs / layout):
        assert p["teacher_rows"] == [1], p


def test_resume_under_cp_and_tp_continues_exactly_and_exports(runs):
    """cp2_tp2 ran step 1, saved, and a fresh Trainer resumed for step 2: both equal the
    reference (test above); here: it did resume, and the export loads with tied weights."""
    run = runs / "cp2_tp2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_this_run"] == 1 and summary["resumed_from"].endswith("step-00000001")
    from tokenbridge.models import load_pretrained

    model = load_pretrained(run / "export")  # strict: no weight missing, none left over
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.lm_head.weight.shape[0] == 49152


@pytest.mark.parametrize("layout", ["tp2", "cp2", "cp2_tp2"])
def test_every_loss_mode_counts_like_one_process(runs, layout):
    """Each mode's terms per target token (its count over the CE count): the same under every
    layout, so each CP rank counted exactly the terms it computed."""
    ref = {r["step"]: r for r in _records(runs / "ref", "train")}
    for r in _records(runs / layout, "train"):
        for m in MODES:
            cov = f"coverage/{m}"
            assert r[cov] == pytest.approx(ref[r["step"]][cov], rel=1e-12), (layout, m)


def test_model_level_cp_and_tp_match_the_whole_model(runs):
    """Logits and every parameter's gradient (relative to its largest entry) of tiny Llama and
    Gemma 3 (sliding-window layers, softcapped logits, scaled embedding) at cp = 2 (K/V
    all-gathered, global positions) and tp = 2 (vocab-sharded lm_head, tied embedding)."""
    checks = json.loads((runs / "model_checks.json").read_text())
    assert set(checks) == {f"{m}_{p}" for m in ("llama", "gemma3") for p in ("cp2", "tp2")}
    for name, diffs in checks.items():
        if name.endswith("tp2"):
            assert diffs.pop("tied") == 1.0, name  # one parameter for embedding and lm_head
        assert len(diffs) > 10, name
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < REL, (name, worst, diffs[worst])


def test_models_built_on_meta_hold_build_models_weights_in_every_layout(runs):
    """The student under FSDP (dp 2), TP (tp 2), both (dp 2 x tp 2, FSDP over a TP-sharded dim)
    and HSDP (2 replicas of 2 shards: placements (Replicate, Shard(0))), and a teacher under
    TP, random-init and pretrained (read by slices), built on the meta device and filled shard
    by shard, gathered: `build_model`'s weights bit for bit, SmolLM2- and Gemma 3-shaped."""
    got = {}
    for which in ("two", "four"):
        got.update(json.loads((runs / f"weights_{which}.json").read_text()))
    want = {
        f"{m}_{who}_{lay}"
        for m in ("smollm2", "gemma3")
        for who in ("student", "teacher", "pretrained_teacher")
        for lay in ("dp2", "tp2", "dp2_tp2", "hsdp2x2")
    }
    want |= {f"{m}_hsdp_placements" for m in ("smollm2", "gemma3")}
    assert set(got) == want
    assert [k for k, ok in got.items() if not ok] == []


def test_resume_on_2_then_1_then_2_processes_repeats_the_uninterrupted_losses(runs):
    """`resize` ran step 1 on 2 processes, step 2 on 1, step 3 on 2, each resuming the one
    before's checkpoint: DCP resharded the student and AdamW, and the data position (rows in
    order) carried over exactly, so every step equals the uninterrupted 1-process run."""
    ref = {r["step"]: r for r in _records(runs / "ref3", "train")}
    got = {r["step"]: r for r in _records(runs / "resize", "train")}
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step, r in got.items():
        assert r["tokens"] == ref[step]["tokens"], step
        for k in KEYS:
            assert r[k] == pytest.approx(ref[step][k], rel=REL), (step, k)
    summary = json.loads((runs / "resize" / "summary.json").read_text())
    assert summary["steps_this_run"] == 1 and summary["resumed_from"].endswith("step-00000002")
    # each part logged the host memory its ranks peaked at while loading
    loads = _records(runs / "resize", "load")
    assert [r["step"] for r in loads] == [0, 1, 2]
    assert all(0 < r["load/host_peak_gib"] < 64 for r in loads)


def test_a_teacher_sharded_over_tp_scores_the_one_process_bpb(runs):
    """Every teacher at tp = 2 (larger than one device, say): its reference BPB computed on
    every rank with the teacher built sharded over its TP group and loaded by shards, equal to
    the whole teacher's in one process."""
    ref = {k: v for r in _records(runs / "ref", "eval") for k, v in r.items() if "bpb/" in k}
    got = {
        k: v
        for r in _records(runs / "dp2_teacher_tp2", "eval")
        for k, v in r.items()
        if "bpb/" in k
    }
    assert sorted(ref) == sorted(got) == [f"bpb/{m}" for m in sorted(MODES)]
    for k, v in got.items():
        assert math.isfinite(v) and v == pytest.approx(ref[k], rel=REL), k
