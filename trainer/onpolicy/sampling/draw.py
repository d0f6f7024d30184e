"""How the sampler draws a token: counter-based uniforms and exact top-p, with no RNG state.

A rollout's uniforms are a hash of (its seed, the step, the round): the same numbers in any
batch, on any device (integer ops that never overflow int64, so CPU and CUDA agree by
construction), computed for every row and a block of steps at once instead of one generator
call per row per step. Top-p takes the first of `ROUNDS` inverse-CDF draws that falls in the
nucleus, and where none does, one inverse-CDF draw over the sorted nucleus itself: either
branch draws from the nucleus renormalised, so the mixture is top-p sampling exactly.

Legend: B rows, V vocabulary, R rejection rounds, W uniforms per row and step, S steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROUNDS = 4  # inverse-CDF draws per step before the nucleus's own draw (each in it w.p. >= top_p)
WIDTH = ROUNDS + 1  # uniforms per row and step: the rounds, then the fallback's
BLOCK = 64  # steps of uniforms computed at once

_M32 = 0xFFFFFFFF
# an invertible 32-bit finaliser: xorshift-multiply rounds with the shifts and multipliers of
# C. Wellons' "triple32" (hash-prospector), whose avalanche bias is among the lowest known
_ROUNDS32 = ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB))
_GOLDEN, _WORD, _SEED = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35  # odd constants that spread counters


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, in 16-bit halves of c so that no
    product reaches 2^63 (a signed overflow's wrap is not something to lean on across devices)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2^32) (int64 tensors) whose every output bit depends on every input bit."""
    for shift, mult in _ROUNDS32:
        x = _mul32(x ^ (x >> shift), mult)
    return x ^ (x >> 14)


def row_keys(seeds: Sequence[int], device) -> torch.Tensor:
    """[B] int64: each rollout's key, a hash of its seed (any int, taken mod 2^64)."""
    s = [int(x) % 2**64 for x in seeds]
    lo = torch.tensor([x & _M32 for x in s], dtype=torch.int64, device=device)
    hi = torch.tensor([x >> 32 for x in s], dtype=torch.int64, device=device)
    return mix32(mix32(lo ^ _SEED) ^ hi)


def uniforms(keys_B: torch.Tensor, *, first: int, steps: int, width: int = WIDTH) -> torch.Tensor:
    """[B, S, W] float64 in [0, 1): the uniforms of steps ``first ..`` for rows keyed ``keys_B``;
    each from two 32-bit hashes of (key, step, word), 53 bits kept."""
    step_S = torch.arange(first, first + steps, dtype=torch.int64, device=keys_B.device)
    h_BS = mix32(keys_B[:, None] ^ _mul32(step_S, _GOLDEN))
    word_2W = torch.arange(1, 2 * width + 1, dtype=torch.int64, device=keys_B.device)
    w_BS2W = mix32(h_BS[..., None] ^ _mul32(word_2W, _WORD))
    bits = (w_BS2W[..., 0::2] << 21) | (w_BS2W[..., 1::2] >> 11)
    return bits.double() * 2.0**-53


class Uniforms:
    """The uniforms of a batch's rollouts, a block of `BLOCK` steps at a time, into one buffer
    kept in place (a captured CUDA graph reads it at its step: `block_BSW`)."""

    def __init__(self, seeds: Sequence[int], *, device):
        self.keys_B = row_keys(seeds, device)
        self.block_BSW: torch.Tensor | None = None
        self.first = -1

    def fill(self, step: int) -> None:
        """Make the block holding ``step`` the current one (a no-op if it already is)."""
        first = step - step % BLOCK
        if first != self.first:
            block = uniforms(self.keys_B, first=first, steps=BLOCK)
            if self.block_BSW is None:
                self.block_BSW = block
            else:
                self.block_BSW.copy_(block)
            self.first = first

    def at(self, step: int) -> torch.Tensor:
        """[B, W]: every row's uniforms at ``step``."""
        self.fill(step)
        return self.block_BSW[:, step - self.first]


def _in_nucleus(probs_BV: torch.Tensor, ids_BR: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, R] bool: each token is in the top-p nucleus, i.e. the tokens more likely than it hold
    less than top_p of the mass (the most likely token always is)."""
    p_BR1 = probs_BV.gather(1, ids_BR)[..., None]
    row_B1V = probs_BV[:, None]
    ahead_BR = torch.where(row_B1V > p_BR1, row_B1V, 0.0).sum(-1)
    return ahead_BR < top_p


def _nucleus_draw(probs_BV: torch.Tensor, u_B: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B]: one inverse-CDF draw per row over its nucleus alone (sorted; ties in id order)."""
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True, stable=True)
    sorted_BV = sorted_BV.double()
    ahead_BV = sorted_BV.cumsum(-1) - sorted_BV
    cdf_BV = torch.where(ahead_BV < top_p, sorted_BV, 0.0).cumsum(-1)
    j_B1 = torch.searchsorted(cdf_BV, u_B[:, None] * cdf_BV[:, -1:], right=True)
    return order_BV.gather(1, j_B1.clamp(max=probs_BV.shape[-1] - 1))[:, 0]


def choose(
    logits_BV: torch.Tensor,
    *,
    config,
    u_BW: torch.Tensor | None,
    static: bool = False,
) -> torch.Tensor:
    """The next token of every row [B] (greedy when temperature is 0), from its uniforms
    ``u_BW`` (`Uniforms.at`; None only when greedy). ``config``: a `SamplingConfig`.

    Top-p without sorting the vocabulary: `ROUNDS` inverse-CDF draws from the whole
    distribution (one searchsorted), the first in the nucleus is kept, and a row with none
    draws over its sorted nucleus. ``static``: every round and the fallback for every row,
    picked by `torch.where` (fixed shapes, no host sync: what a CUDA graph captures); else
    round by round for the rows still rejected and the fallback only where needed (a host check
    per round, cheaper on CPU). Both give the same tokens."""
    x = logits_BV.float()
    if config.temperature == 0:
        return x.argmax(-1)
    probs_BV = torch.softmax(x / config.temperature, dim=-1)
    cdf_BV = probs_BV.double().cumsum(-1)
    # right: a token of probability 0 (an empty CDF step) is never drawn
    ids_BR = torch.searchsorted(cdf_BV, u_BW[:, :ROUNDS] * cdf_BV[:, -1:], right=True)
    ids_BR = ids_BR.clamp(max=probs_BV.shape[-1] - 1)
    if config.top_p >= 1:
        return ids_BR[:, 0]
    top_p = config.top_p
    if static:
        ok_BR = _in_nucleus(probs_BV, ids_BR, top_p)
        first_B1 = ok_BR.to(torch.int8).argmax(-1, keepdim=True)  # the first accepted round
        kept_B = ids_BR.gather(1, first_B1)[:, 0]
        return torch.where(ok_BR.any(-1), kept_B, _nucleus_draw(probs_BV, u_BW[:, ROUNDS], top_p))
    ids_B = ids_BR[:, 0].clone()
    todo_B = ~_in_nucleus(probs_BV, ids_BR[:, :1], top_p)[:, 0]
    for r in range(1, ROUNDS + 1):
        if not bool(todo_B.any()):
            break
        rows = todo_B.nonzero().squeeze(1)
        if r == ROUNDS:  # no round accepted: the nucleus's own draw
            ids_B[rows] = _nucleus_draw(probs_BV[rows], u_BW[rows, ROUNDS], top_p)
            break
        again_R1 = ids_BR[rows, r : r + 1]
        ok_R = _in_nucleus(probs_BV[rows], again_R1, top_p)[:, 0]
        ids_B[rows[ok_R]] = again_R1[ok_R, 0]
        todo_B[rows[ok_R]] = False
    return ids_B


def drawn_logprobs(logits_BV: torch.Tensor, ids_B: torch.Tensor, *, config) -> torch.Tensor:
    """[B] float32: log-probability of each drawn token under the distribution `choose` drew it
    from: the tempered softmax, restricted to the top-p nucleus and renormalised (the nucleus:
    the most likely tokens until their mass reaches top_p, as `_in_nucleus` decides)."""
    logp_BV = torch.log_softmax(logits_BV.float() / config.temperature, dim=-1)
    out_B = logp_BV.gather(1, ids_B[:, None])[:, 0]
    if config.top_p < 1:
        out_B = out_B - _nucleus_mass(logp_BV.exp(), config.top_p).log()
    return out_B


def _nucleus_mass(p_BV: torch.Tensor, top_p: float, k: int = 256) -> torch.Tensor:
    """[B]: the top-p nucleus's mass, from the k most likely tokens where they hold top_p (then
    the (k+1)-th is outside: the mass ahead of it is >= top_p), else from the sorted row (a
    whole sort of 49k columns is ~30x a top-256)."""

    def mass(sorted_BV):
        ahead_BV = sorted_BV.cumsum(-1) - sorted_BV  # the mass before each token in the order
        return torch.where(ahead_BV < top_p, sorted_BV, 0.0).sum(-1)

    top_BK = p_BV.topk(min(k, p_BV.shape[-1]), -1).values
    out_B = mass(top_BK)
    wide = (top_BK.sum(-1) < top_p).nonzero().squeeze(1)
    if wide.numel():
        out_B[wide] = mass(p_BV[wide].sort(-1, descending=True).values)
    return out_B
