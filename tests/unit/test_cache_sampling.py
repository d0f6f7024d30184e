"""The teacher-cache job's sampled ids (`pipelines.teacher_cache.sampled_ids`): each draw is the
inverse CDF of the teacher's softmax at its counter-based uniform, on the logits' own device.

No Beam here (the GPU check's ``pytest -m cuda`` runs on an image without it); the job-level
tests of `--samples` are in tests/pipeline/test_teacher_cache_job.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.teacher_cache.sampled_ids import Sampler, sample_keys, uniforms

VOCAB, R = 300, 16


def _logits(rows: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(rows, n, VOCAB + 20, generator=g) * 2  # padded lm_head columns


def _reference(logits_BnV: torch.Tensor, keys: np.ndarray, *, tau: float) -> np.ndarray:
    """The draws in numpy float64: the first id whose CDF exceeds u x total mass."""
    b, n, _ = logits_BnV.shape
    x = logits_BnV[..., :VOCAB].double().numpy() / tau
    p = np.exp(x - x.max(-1, keepdims=True))
    cdf = np.cumsum(p, -1)
    u = uniforms(keys, 0, n, R)
    out = np.empty((b, n, R), np.int64)
    for i in range(b):
        for t in range(n):
            out[i, t] = np.searchsorted(cdf[i, t], u[i, t] * cdf[i, t, -1], side="right")
    return out.clip(max=VOCAB - 1)


def _draw(logits_BnV: torch.Tensor, keys: np.ndarray, *, tau: float) -> np.ndarray:
    s = Sampler(keys, logits_BnV.shape[1], r=R, vocab_size=VOCAB, temperature=tau)
    s(0, logits_BnV)
    return s.ids


def test_sampled_ids_are_the_inverse_cdf_at_their_uniforms():
    logits = _logits(3, 5)
    keys = sample_keys(11, "shard-00000-of-00001.arrow", np.arange(3))
    for tau in (1.0, 0.7):
        got = _draw(logits, keys, tau=tau)
        assert (got < VOCAB).all()  # never a padded column
        assert np.array_equal(got, _reference(logits, keys, tau=tau)), tau


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampled_ids_from_cuda_logits_equal_the_cpu_draws():
    """The uniforms go to the logits' device (a CUDA CDF times a CPU uniform is an error):
    CUDA logits draw the ids the same logits draw on the CPU."""
    logits = _logits(3, 5)
    keys = sample_keys(11, "shard-00000-of-00001.arrow", np.arange(3))
    cpu = _draw(logits, keys, tau=1.0)
    assert np.array_equal(_draw(logits.cuda(), keys, tau=1.0), cpu)
