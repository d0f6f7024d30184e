"""The fused teacher pass (`tokenbridge.teacher.fused_topk`) against the float64 dense reference:
eager (ms each), through `teacher_outputs_from_logits` and `teacher_forward` (the deferred
soft cap), and compiled once at a small shape with dynamic rows (~10 s: the suite's one compile).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenbridge.teacher import fused_topk
from tokenbridge.teacher.forward import teacher_forward
from tokenbridge.teacher.outputs import TeacherOutputSpec, Workspace, teacher_outputs_from_logits

NEG = float("-inf")
WIDTH, VOCAB, K = 8192, 8000, 8  # 32 blocks of 256, padded columns past VOCAB
REL = dict(rtol=1e-6, atol=1e-12)  # atol: where the reference is 0 (log1p of < 1e-16)


def _span(rows: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw head output: fp32 without ties, a dominant column, a row with fewer finite columns
    than K, an all -inf row; and targets (-1: none)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=g, dtype=torch.float64) * 3
    x[:, VOCAB:] = 50.0  # padding: must never win
    x[0, 300] = 60.0  # one column holds all but ~e-40 of the mass
    x[1, : VOCAB - 3] = NEG
    x[2, :] = NEG
    tgt = torch.randint(0, VOCAB, (rows,), generator=g)
    tgt[3] = -1
    return x.to(dtype), tgt


def _dense(x: torch.Tensor, tgt: torch.Tensor, tf: fused_topk.Transform):
    """(top-k log-probs, ids, tail log-prob, target log-prob at temperature 1) in float64."""
    y = x.double()
    if tf.softcap:
        y = torch.tanh(y / tf.softcap) * tf.softcap
    y[:, tf.vocab_size :] = NEG
    lp = torch.log_softmax(y / tf.temperature, -1)
    vals, ids = torch.topk(lp, K, -1)
    tail = torch.logsumexp(lp.scatter(-1, ids, NEG), -1)
    target = torch.log_softmax(y, -1).gather(-1, tgt.clamp(min=0)[:, None])[:, 0]
    return lp, vals, ids, tail, torch.where(tgt >= 0, target, 0.0)


def _check(got: dict, x: torch.Tensor, tgt: torch.Tensor, tf: fused_topk.Transform) -> None:
    """``got`` (`fused_topk.spec_fields`) within 1e-6 relative of the dense reference; the all -inf
    row (2) all -inf with ids -1, as the whole-row path gives it (capped, -inf is -cap: ties)."""
    lp, vals, ids, tail, target = _dense(x, tgt, tf)
    live = torch.ones(x.shape[0], dtype=torch.bool)
    live[2] = bool(tf.softcap)
    out_ids = got["topk_ids"].long()
    # the ids name columns of the reference's values (ties aside), and where fp32 rows have no
    # ties (not rows 1-2), they are its ids
    named = lp.gather(-1, out_ids.clamp(min=0))
    torch.testing.assert_close(named[live], torch.where(out_ids >= 0, vals, NEG)[live], **REL)
    if x.dtype == torch.float32:
        assert torch.equal(out_ids[3:], ids[3:]) and torch.equal(out_ids[0], ids[0])
    assert torch.equal(out_ids >= 0, vals > NEG)
    torch.testing.assert_close(got["topk_logprobs"].double()[live], vals[live], **REL)
    torch.testing.assert_close(got["tail_logprob"].double()[live], tail[live], **REL)
    if tf.target:
        torch.testing.assert_close(got["target_logprob"].double()[live], target[live], **REL)
    if not tf.softcap:
        assert (got["topk_ids"][2] == -1).all() and (got["topk_logprobs"][2] == NEG).all()
        assert got["tail_logprob"][2] == NEG
    if not tf.softcap and tf.temperature == 1.0:  # exact beside a dominant column (not 1 - sum)
        assert -60 < got["tail_logprob"][0] < -30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_eager_pass_matches_float64_dense(dtype, softcap, tau):
    x, tgt = _span(13, dtype)  # 13 rows: no multiple of anything
    tf = fused_topk.Transform(VOCAB, softcap=softcap, temperature=tau, target=True)
    got = fused_topk.topk_fields(x, tgt, tf, K, how="eager")
    _check(fused_topk.spec_fields(got, tgt), x, tgt, tf)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_groups_equal_the_whole_row_function(softcap):
    """The eager row groups compute what the compiled function does, in whole-row ops."""
    x, _ = _span(5, torch.bfloat16)
    tf = fused_topk.Transform(VOCAB, softcap=softcap, temperature=2.0, target=True)
    work = torch.empty(2 * 5 * WIDTH)  # two buffers of `blocked.pass_rows` (5) rows
    whole, groups = fused_topk.stats_whole(x, tf, 256), fused_topk.stats_groups(x, tf, 256, work)
    for a, b in zip(whole, groups, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_widths_without_blocks_fall_back():
    """No block size for odd widths or too few blocks: None, and the outputs take the
    whole-row path, capping there what the head left uncapped."""
    tf = fused_topk.Transform(50, softcap=2.0)
    assert fused_topk.topk_fields(torch.randn(3, 50), None, tf, 4, how="eager") is None
    assert (
        fused_topk.topk_fields(torch.randn(3, 1024), None, tf, 4, how="eager") is None
    )  # 4 blocks
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 8191, generator=g) * 3
    spec = TeacherOutputSpec(8000, topk=4, target=True, chunk_size=4)
    tgt = torch.randint(0, 8000, (2, 5), generator=g)
    capped = torch.tanh(x / 2.0) * 2.0
    want = teacher_outputs_from_logits(capped, spec=spec, target_ids_BT=tgt)
    got = teacher_outputs_from_logits(x.clone(), spec=spec, target_ids_BT=tgt, softcap=2.0)
    for name, val in want.tensors().items():
        torch.testing.assert_close(getattr(got, name), val, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_outputs_fused_equal_blocked(monkeypatch, tau):
    """`teacher_outputs_from_logits` by the fused pass (raw logits, the cap given) and by the
    blocked passes (capped logits): the same fields up to float rounding."""
    x, tgt = _span(12, torch.float32)
    x, tgt = x.view(2, 6, WIDTH), tgt.view(2, 6)
    spec = TeacherOutputSpec(VOCAB, topk=K, target=True, temperature=tau, chunk_size=8)
    monkeypatch.setenv(fused_topk.MODE_ENV, "off")
    want = teacher_outputs_from_logits(torch.tanh(x / 30.0) * 30.0, spec=spec, target_ids_BT=tgt)
    monkeypatch.setenv(fused_topk.MODE_ENV, "eager")
    got = teacher_outputs_from_logits(x, spec=spec, target_ids_BT=tgt, softcap=30.0)
    assert torch.equal(got.topk_ids, want.topk_ids)
    for name in ("topk_logprobs", "tail_logprob", "target_logprob"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)


def test_mode_rule(monkeypatch):
    """auto: compiled on CUDA; on the CPU eager for bf16 or capped logits, else off."""
    monkeypatch.delenv(fused_topk.MODE_ENV, raising=False)
    assert fused_topk.mode("cuda") == "compiled" and fused_topk.mode("cpu") == "off"
    assert fused_topk.mode("cpu", dtype=torch.bfloat16) == "eager"
    assert fused_topk.mode("cpu", softcap=30.0) == "eager"
    monkeypatch.setenv(fused_topk.MODE_ENV, "eager")
    assert fused_topk.mode("cuda") == "eager"
    monkeypatch.setenv(fused_topk.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="expected auto"):
        fused_topk.mode("cpu")


def _capped_model(hidden: torch.Tensor, head: torch.nn.Linear, cap: float):
    return SimpleNamespace(
        model=lambda **kw: SimpleNamespace(last_hidden_state=hidden),
        lm_head=head,
        config=SimpleNamespace(final_logit_softcapping=cap),
    )


def test_teacher_forward_leaves_the_cap_to_the_fused_pass(monkeypatch):
    """A plain head's product stays raw when the fused pass caps it; ``on_logits`` still sees
    capped logits; all three agree with the cap applied in place (the blocked passes)."""
    g = torch.Generator().manual_seed(4)
    B, U, H = 2, 5, 8
    hidden = torch.randn(B, U, H, generator=g)
    head = torch.nn.Linear(H, WIDTH, bias=False)
    torch.nn.init.normal_(head.weight, std=1.5, generator=g)
    model = _capped_model(hidden, head, 5.0)
    ids = torch.randint(0, VOCAB, (B, U), generator=g)
    mask = torch.ones(B, U, dtype=torch.int64)
    spec = TeacherOutputSpec(VOCAB, topk=K, target=True)
    seen = []

    def run(how: str, on_logits=None):
        """The outputs, and the largest |logit| of the last span's product as the head left it."""
        monkeypatch.setenv(fused_topk.MODE_ENV, how)
        work = Workspace()
        kw = {"spec": spec, "columns": None, "chunk": 2, "on_logits": on_logits}
        out = teacher_forward(model, ids, mask, workspace=work, **kw)
        return out, float(work.get("logits", B, WIDTH, "cpu").abs().max())

    want, top = run("off")
    assert top <= 5.0  # capped in place
    for (got, top), raw in (
        (run("eager"), True),
        (run("eager", on_logits=lambda t0, x: seen.append(x.clone())), False),
    ):
        assert (top > 5.0) == raw  # left raw for the fused pass, unless on_logits reads it
        assert torch.equal(got.topk_ids, want.topk_ids)
        for name in ("topk_logprobs", "tail_logprob", "target_logprob"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name))
    logits = torch.cat(seen, 1)
    torch.testing.assert_close(logits, torch.tanh((hidden @ head.weight.T) / 5.0) * 5.0)


def test_compiled_pass_matches_float64_dense_without_recompiling():
    """The `torch.compile`d function (the CUDA path) at one small shape: bf16 input, the cap,
    a temperature with the target (both sums), padding; a second span of other rows reuses
    the graph (rows are dynamic)."""
    from torch._dynamo.utils import counters

    tf = fused_topk.Transform(VOCAB, softcap=30.0, temperature=2.0, target=True)
    for rows in (6, 11):
        x, tgt = _span(rows, torch.bfloat16, seed=rows)
        got = fused_topk.topk_fields(x, tgt, tf, K, how="compiled")
        if rows == 6:
            frames = counters["frames"]["ok"]
        _check(fused_topk.spec_fields(got, tgt), x, tgt, tf)
    assert counters["frames"]["ok"] == frames  # no recompile for the new row count
