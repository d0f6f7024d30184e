"""The loop's step numbers on the host: one read of the device tensors (`read_step`), the
logged record (`train_metrics`), and what the non-finite guard names. Pure functions, no run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.run_log import nonfinite_message, nonfinite_terms, read_step, train_metrics

NAN, INF = float("nan"), float("inf")


def test_one_read_splits_into_losses_checks_sums_counts_and_norm():
    # two KD terms: [ce, kd_a, kd_b, total, missed_a, missed_b, then two named sums]
    shares = torch.tensor([1.5, 0.25, 0.5, 2.0, 0.0, 3.0, 7.0, 9.0], dtype=torch.float64)
    counts = torch.tensor([10.0, 8.0, 4.0, 12.0], dtype=torch.float64)
    nums = read_step(shares, counts, torch.tensor(0.75), n_terms=2, names=["a/x_sum", "b/y_sum"])
    assert nums.losses == [1.5, 0.25, 0.5, 2.0] and nums.missed == [0.0, 3.0]
    assert nums.counts == [10.0, 8.0, 4.0, 12.0] and nums.grad_norm == 0.75
    assert nums.loss_sums == {"a/x_sum": 7.0, "b/y_sum": 9.0}


def test_the_record_keeps_the_keys_the_loop_always_logged():
    shares = torch.tensor([2.0, 0.5, 2.5, 0.0, 6.0, 1.0], dtype=torch.float64)
    counts = torch.tensor([20.0, 15.0, 24.0], dtype=torch.float64)
    names = ["t/kd_sum", "t/chunks_empty_side"]  # only *_sum names are logged, as means
    nums = read_step(shares, counts, torch.tensor(1.25), n_terms=1, names=names)
    host = {"lr": 1e-3, "step_s": 2.0, "teacher_s": 0.5, "memory_gib": 1.0, "epoch": 0}
    m = train_metrics(nums, terms=["t"], kd_weights=[1.0], host=host)
    assert m == {
        "loss": 2.5, "ce": 2.0, "kd/t": 0.5, "coverage/t": 0.75, "kd": 0.5, **host,
        "grad_norm": 1.25, "tokens": 24, "tokens_per_s": 12.0, "t/kd_mean": 6.0 / 15.0,
    }  # fmt: skip
    ce_only = read_step(shares[:2], counts[[0, 2]], torch.tensor(1.0), n_terms=0, names=[])
    assert set(train_metrics(ce_only, terms=[], kd_weights=[], host=host)) == {
        "loss", "ce", "grad_norm", "tokens", "tokens_per_s", *host}  # fmt: skip


@pytest.mark.parametrize(
    ("losses", "norm", "named"),
    [
        ([NAN, 0.1, 0.2, NAN], NAN, ["CE (nan)", "the gradient norm (nan)"]),
        ([1.0, 0.1, INF, INF], 3.0, ["KD of teacher b (inf)"]),
        ([1.0, 0.1, 0.2, INF], 3.0, ["the combined loss (inf)"]),
        ([1.0, 0.1, 0.2, 1.3], INF, ["the gradient norm (inf)"]),
        ([1.0, 0.1, 0.2, 1.3], 3.0, []),
    ],
)
def test_the_guard_names_each_non_finite_term(losses, norm, named):
    assert nonfinite_terms(losses, terms=["a", "b"], grad_norm=norm) == named


def test_the_guard_message_names_the_step_and_where_to_resume():
    found = ["KD of teacher gemma (nan)"]
    msg = nonfinite_message(7, found, last_checkpoint=Path("runs/x/checkpoints/step-00000005"))
    assert msg.startswith("step 7: non-finite KD of teacher gemma (nan);")
    assert "runs/x/checkpoints/step-00000005" in msg and "optim.skip_nonfinite=true" in msg
    assert "No checkpoint was saved" in nonfinite_message(1, found, last_checkpoint=None)
