"""A served teacher's answer -> `TeacherOutputs` (`tokenbridge.teacher.served.row_outputs`), against
the worker's own computation from dense logits (`teacher_outputs_from_logits`).

The answers are written as vLLM's ``/v1/completions`` writes them (prompt_logprobs: None, then
per position a dict of the top-k ids plus the realised token with its rank; the generated
token's top_logprobs keyed ``token_id:N``) from a real distribution, so the shift (position t's
distribution is entry t + 1), the realised token outside the top-k, and the tail in float64 are
checked value by value; broken answers are refused by name.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenbridge.teacher.outputs import TeacherOutputSpec, teacher_outputs_from_logits
from tokenbridge.teacher.served import BadAnswerError, row_outputs, tail_logprob

V, K, N = 300, 8, 12


def answer_of(logits_NV: torch.Tensor, ids: list[int], k: int) -> dict:
    """What vLLM returns for a prompt of `ids` whose next-token logits are `logits_NV`
    (row t: the distribution after ids[:t + 1])."""
    lp = torch.log_softmax(logits_NV.double(), -1)
    order = lp.argsort(-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(1, lp.shape[1] + 1).expand_as(order).contiguous())
    prompt: list = [None]
    for t in range(1, len(ids)):
        row = {str(int(i)): {"logprob": float(lp[t - 1, i]), "rank": int(rank[t - 1, i]),
                             "decoded_token": "x"} for i in order[t - 1, :k]}  # fmt: skip
        nxt = ids[t]
        row[str(nxt)] = {"logprob": float(lp[t - 1, nxt]), "rank": int(rank[t - 1, nxt])}
        prompt.append(row)
    last = {f"token_id:{int(i)}": float(lp[-1, i]) for i in order[-1, :k]}
    return {"prompt_logprobs": prompt, "logprobs": {"top_logprobs": [last]}}


@pytest.fixture
def row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (N,), generator=g).tolist()
    ids[5] = int(logits[4].argmin())  # a realised token far outside the top-k
    return logits, ids


def test_row_outputs_equal_the_workers_from_dense_logits(row):
    logits, ids = row
    got = row_outputs(answer_of(logits, ids, K), ids, k=K, vocab_size=V, where="row 0")
    spec = TeacherOutputSpec(V, topk=K, target=True)
    targets = torch.tensor([*ids[1:], -1])[None]
    ref = teacher_outputs_from_logits(logits.float()[None], spec=spec, target_ids_BT=targets)
    assert np.array_equal(got.topk_ids, ref.topk_ids[0].numpy())
    np.testing.assert_allclose(got.topk_logprobs, ref.topk_logprobs[0].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.tail_logprob, ref.tail_logprob[0].numpy(), rtol=0, atol=1e-5)
    # position t's target is log p(ids[t + 1]); the last position predicts nothing: 0
    np.testing.assert_allclose(got.target_logprob, ref.target_logprob[0].numpy(), atol=1e-5)
    assert got.target_logprob[-1] == 0 and got.target_logprob[4] < got.topk_logprobs[4, -1]


def test_tail_is_the_complement_in_float64():
    with np.errstate(divide="ignore"):
        lp = np.log(np.array([[0.5, 0.3, 0.2 - 1e-9], [0.5, 0.5, 0.0]]))
    tail = tail_logprob(lp)
    assert tail[0] == pytest.approx(math.log(1e-9), rel=1e-6)  # float32 would give log(0)
    assert tail[1] == -math.inf


def test_broken_answers_are_refused_by_name(row):
    logits, ids = row
    good = answer_of(logits, ids, K)
    short = {**good, "prompt_logprobs": good["prompt_logprobs"][:-1]}
    with pytest.raises(BadAnswerError, match=f"row 3: prompt_logprobs of {N - 1} positions, "
                       f"expected {N}"):  # fmt: skip
        row_outputs(short, ids, k=K, vocab_size=V, where="row 3")
    nan = answer_of(logits, ids, K)
    key = next(iter(nan["prompt_logprobs"][3]))
    nan["prompt_logprobs"][3][key]["logprob"] = float("nan")
    with pytest.raises(BadAnswerError, match="row 0 position 2: non-finite or positive"):
        row_outputs(nan, ids, k=K, vocab_size=V, where="row 0")
    with pytest.raises(BadAnswerError, match=r"token ids outside \[0, 100\)"):
        row_outputs(good, ids, k=K, vocab_size=100, where="row 0")
    top = [ids[0], int(logits[0].argmax()), *ids[2:]]  # position 0's next token in its top-k
    with pytest.raises(BadAnswerError, match="position 0: 8 log-probs, expected at least k=9"):
        row_outputs(answer_of(logits, top, K), top, k=K + 1, vocab_size=V, where="row 0")
    other = list(ids)
    other[1] = (ids[1] + 1) % V
    with pytest.raises(BadAnswerError, match="no log-prob for the row's next token"):
        row_outputs(good, other, k=K, vocab_size=V, where="row 0")
