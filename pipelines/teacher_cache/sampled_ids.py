"""Sampled ids of the teacher-cache job: R ids per position, reproducible whatever the batching.

Each row's draws come from a counter-based stream rooted in (seed, shard file, row)
(`sample_keys`, `uniforms`), so a row sampled alone or in any batch, on any worker, gets the
same ids; `Sampler` draws them from the teacher's logits on the logits' own device. No Beam
here: a GPU check imports it on a machine without Beam.

Legend: B rows, n positions of one lm_head chunk, R samples, V vocab.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def sample_keys(seed: int, shard_file: str, rows: np.ndarray) -> np.ndarray:
    """uint64 per row: the root of its sampling stream, from (seed, shard file, row) only, so the
    draws never depend on how rows were batched."""
    out = np.empty(len(rows), np.uint64)
    for i, r in enumerate(rows):
        h = hashlib.blake2b(f"{seed}/{shard_file}/{int(r)}".encode(), digest_size=8)
        out[i] = np.frombuffer(h.digest(), np.uint64)[0]
    return out


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # a well-mixed 64-bit hash (uint64 arithmetic wraps in numpy arrays)
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniforms(keys_B: np.ndarray, t0: int, n: int, r: int) -> np.ndarray:
    """float64 [B, n, r] in [0, 1): draw j at position t0 + i of row b, counter-based."""
    counter = (np.arange(t0, t0 + n, dtype=np.uint64)[:, None] * np.uint64(r)) + np.arange(
        r, dtype=np.uint64
    )
    z = _splitmix64(keys_B[:, None, None] ^ _splitmix64(counter)[None])
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


class Sampler:
    """``on_logits`` hook: R ids per position drawn from softmax(logits / tau) over the vocab."""

    def __init__(self, keys_B: np.ndarray, u: int, *, r: int, vocab_size: int, temperature: float):
        self.keys, self.r, self.vocab, self.tau = keys_B, r, vocab_size, temperature
        self.ids = np.zeros((len(keys_B), u, r), np.int64)

    @torch.no_grad()
    def __call__(self, t0: int, logits_BnV: torch.Tensor) -> None:
        b, n, _ = logits_BnV.shape
        # the uniforms go to the logits' device: a CUDA cdf times a CPU uniform is an error
        u_Nr = torch.from_numpy(uniforms(self.keys, t0, n, self.r)).reshape(b * n, self.r)
        u_Nr = u_Nr.to(logits_BnV.device)
        x = logits_BnV.reshape(b * n, -1)[:, : self.vocab]
        out = torch.empty(b * n, self.r, dtype=torch.int64)
        for s in range(0, b * n, 32):  # float64 cdf of 32 rows at a time (64 MiB at 262k)
            p = torch.softmax(x[s : s + 32].double() / self.tau, -1)
            cdf = p.cumsum(-1)
            pick = torch.searchsorted(
                cdf, (u_Nr[s : s + 32] * cdf[:, -1:]).contiguous(), right=True
            )
            out[s : s + 32] = pick.clamp(max=self.vocab - 1).cpu()
        self.ids[:, t0 : t0 + n] = out.reshape(b, n, self.r).numpy()
