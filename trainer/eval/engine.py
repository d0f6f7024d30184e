"""The forward passes behind the scorer: batch planning and the two ways of running a batch.

Per-context (one KV-cached forward of the unique contexts, continuations fed on top) or
shared-prefix (a few-shot prefix run once), whichever computes fewer tokens; both keep each row's
real tokens contiguous in the cache, as sliding-window layers need, and run in segments that
bound activations and logits (docs/eval.md, "Benchmarks").

Legend: B items (contexts) in a batch, C continuation rows, T positions, V vocabulary,
N kept (scored) positions, K cached positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import modeling_utils

# a boolean [B, T] `logits_to_keep` (logits only where a token is scored) came with
# `slice_logits_to_keep` in transformers 5.2x; older ones (5.17 on a GPU image) index
# hidden[:, keep, :] and fail: there the whole segment's logits are computed and masked here
MASK_KEEP = hasattr(modeling_utils, "slice_logits_to_keep")
SHARED_MIN = 48  # tokens a prefix must share before it is worth running once


class ModelDoesNotFitError(MemoryError):
    """The model (or a batch) does not fit in the device's memory; the message says what to try."""


@dataclass(frozen=True)
class BatchLimits:
    max_items: int = 16  # items (contexts) per batch
    max_tokens: int = 2048  # padded tokens per forward
    max_logits: int = 2**26  # elements of one float32 [N, V] logits block (256 MiB)
    cache_tokens: int = 0  # rows x length of the repeated KV cache; 0 = 4 x max_tokens

    def cache_limit(self) -> int:
        return self.cache_tokens or 4 * self.max_tokens


@dataclass(frozen=True)
class Plan:
    items: list[int]
    shared: int  # prefix tokens run once for every item (0 = per-context plan)


def _lcp(seqs: list[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for k in range(n):
        if any(s[k] != first[k] for s in seqs[1:]):
            return k
    return n


def _pack(items, members: list[int], *, limits: BatchLimits, shared: int) -> list[list[int]]:
    """Greedy batches, longest first (an OOM shows early), within the token and cache limits."""

    def dims(i: int) -> tuple[int, int, int]:
        it = items[i]
        return (
            len(it.context) - shared,
            max(len(c) for c in it.continuations),
            len(it.continuations),
        )

    batches, cur = [], []
    lc = lm = rows = 0
    for i in sorted(members, key=lambda i: -sum(dims(i)[:2])):
        c, m, k = dims(i)
        nlc, nlm, nrows = max(lc, c), max(lm, m), rows + k
        if shared:  # rows = rest of context + continuation
            cost, cache = nrows * (nlc + nlm), nrows * (shared + nlc + nlm)
        else:
            cost, cache = (len(cur) + 1) * nlc + nrows * nlm, nrows * (nlc + nlm)
        over = cost > limits.max_tokens or cache > limits.cache_limit()
        if cur and (over or len(cur) >= limits.max_items):
            batches.append(cur)
            cur, nlc, nlm, nrows = [], c, m, k
        cur.append(i)
        lc, lm, rows = nlc, nlm, nrows
    return batches + ([cur] if cur else [])


def plan_batches(items, limits: BatchLimits) -> list[Plan]:
    """Items grouped by their first ``SHARED_MIN`` context tokens; a group whose common prefix
    saves tokens runs it once per batch, everything else goes per-context."""
    groups: dict[tuple[int, ...], list[int]] = {}
    loose: list[int] = []
    for i, it in enumerate(items):
        if len(it.context) > SHARED_MIN:
            groups.setdefault(tuple(it.context[:SHARED_MIN]), []).append(i)
        else:
            loose.append(i)
    plans = []
    for members in groups.values():
        ctxs = [items[i].context for i in members]
        p = min(_lcp(ctxs), min(len(c) for c in ctxs) - 1)  # every row keeps >= 1 own token
        k = sum(len(items[i].continuations) for i in members) / len(members)
        rest = sum(len(c) for c in ctxs) / len(ctxs) - p
        # run the prefix once unless re-running each row's rest per continuation costs more
        if len(members) > 1 and (k - 1) * len(members) * rest < (len(members) - 1) * p:
            plans += [Plan(b, p) for b in _pack(items, members, limits=limits, shared=p)]
        else:
            loose += members
    plans += [Plan(b, 0) for b in _pack(items, loose, limits=limits, shared=0)]
    return plans


def forward_checked(model, **kw):
    """``model(**kw, use_cache=True)`` with out-of-memory turned into a clear error."""
    try:
        return model(use_cache=True, **kw)
    except torch.OutOfMemoryError as e:
        raise ModelDoesNotFitError(
            f"out of device memory in a forward of {tuple(kw['input_ids'].shape)} tokens: "
            "lower --batch-size/--batch-tokens, use --dtype bfloat16, or --device cpu"
        ) from e
    except RuntimeError as e:
        if "memory" in str(e).lower() and "allocat" in str(e).lower():
            raise ModelDoesNotFitError(f"out of host memory ({e}); lower --batch-tokens") from e
        raise


def _vocab_width(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits to fp32 for the softmax; fp32 and fp64 stay as they are."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _prefill(model, ids_BT, *, mask_BT, pos_BT, limits):
    """Run the (left-padded) prefix rows in segments; the cache and the last position's logits."""
    cache, out, seg = None, None, max(1, limits.max_tokens // ids_BT.shape[0])
    for s in range(0, ids_BT.shape[1], seg):
        e = min(ids_BT.shape[1], s + seg)
        out = forward_checked(
            model,
            input_ids=ids_BT[:, s:e],
            attention_mask=mask_BT[:, :e],
            position_ids=pos_BT[:, s:e],
            past_key_values=cache,
            logits_to_keep=1,
        )
        cache = out.past_key_values
    return cache, out.logits[:, -1]


def _feed(model, cache, *, base_mask_CK, base_len_C, seqs, starts, limits, vocab, acc) -> None:
    """Feed rows ``seqs[r][:-1]`` on top of the cache; score ``seqs[r][k]`` for k >= starts[r]
    into ``acc`` = (summed log-prob per row, count of non-greedy tokens per row)."""
    n, length = len(seqs), max(len(s) for s in seqs) - 1
    if length <= 0:
        return
    device = base_mask_CK.device
    inp_CT = torch.zeros(n, length, dtype=torch.long)
    tgt_CT = torch.zeros(n, length, dtype=torch.long)
    real_CT = torch.zeros(n, length, dtype=torch.long)
    keep_CT = torch.zeros(n, length, dtype=torch.bool)
    for r, (s, k0) in enumerate(zip(seqs, starts)):
        inp_CT[r, : len(s) - 1] = torch.tensor(s[:-1])
        tgt_CT[r, : len(s) - 1] = torch.tensor(s[1:])
        real_CT[r, : len(s) - 1] = 1
        keep_CT[r, k0 - 1 : len(s) - 1] = True  # input position j predicts token j + 1
    inp_CT, tgt_CT, real_CT, keep_CT = (t.to(device) for t in (inp_CT, tgt_CT, real_CT, keep_CT))
    pos_CT = base_len_C[:, None] + torch.arange(length, device=device)
    seg = max(1, min(limits.max_tokens // n, limits.max_logits // (n * _vocab_width(model))))
    total_C, misses_C = acc
    for s in range(0, length, seg):
        if not keep_CT[:, s:].any():
            break
        e = min(length, s + seg)
        keep = keep_CT[:, s:e]
        out = forward_checked(
            model,
            input_ids=inp_CT[:, s:e],
            attention_mask=torch.cat([base_mask_CK, real_CT[:, :e]], dim=1),
            position_ids=pos_CT[:, s:e],
            past_key_values=cache,
            logits_to_keep=keep if MASK_KEEP else 0,
        )
        cache = out.past_key_values
        if not keep.any():
            continue
        # a segment's whole logits fit `limits.max_logits` (seg above), so an older transformers
        # costs no more memory than the mask would
        logits = out.logits if MASK_KEEP else out.logits[keep]
        # log p = logit - logsumexp: no second [N, V] tensor for a full log-softmax
        logits_NV = _upcast(logits.reshape(-1, logits.shape[-1])[:, :vocab])
        tgt_N = tgt_CT[:, s:e][keep]
        rows_N = keep.nonzero()[:, 0]  # the kept logits come in this row-major order
        logp_N = logits_NV.gather(1, tgt_N[:, None])[:, 0] - torch.logsumexp(logits_NV, -1)
        total_C.index_add_(0, rows_N, logp_N.double())
        misses_C.index_add_(0, rows_N, (logits_NV.argmax(-1) != tgt_N).long())


def score_batch(model, items, plan: Plan, *, limits: BatchLimits, device, vocab: int | None):
    """(summed log-prob, non-greedy count) per continuation row, rows in item order."""
    owner = [b for b, it in enumerate(items) for _ in it.continuations]
    conts = [c for it in items for c in it.continuations]
    owner_C = torch.tensor(owner, device=device)
    total_C = torch.zeros(len(conts), dtype=torch.float64, device=device)
    misses_C = torch.zeros(len(conts), dtype=torch.long, device=device)
    if plan.shared:
        p = plan.shared
        prefix = torch.tensor([items[0].context[:p]], device=device)
        pos = torch.arange(p, device=device)[None]
        ones = torch.ones_like(prefix)
        cache, _ = _prefill(model, prefix, mask_BT=ones, pos_BT=pos, limits=limits)
        cache.batch_select_indices(torch.zeros_like(owner_C))
        seqs = [items[b].context[p:] + c for b, c in zip(owner, conts)]
        starts = [len(items[b].context) - p for b in owner]
        base_mask = torch.ones(len(conts), p, dtype=torch.long, device=device)
        base_len = torch.full((len(conts),), p, device=device)
        _feed(
            model,
            cache,
            base_mask_CK=base_mask,
            base_len_C=base_len,
            seqs=seqs,
            starts=starts,
            limits=limits,
            vocab=vocab,
            acc=(total_C, misses_C),
        )
        return total_C.tolist(), misses_C.tolist()
    lc = max(len(it.context) for it in items)
    ids_BT = torch.zeros(len(items), lc, dtype=torch.long)
    mask_BT = torch.zeros(len(items), lc, dtype=torch.long)
    for b, it in enumerate(items):
        ids_BT[b, lc - len(it.context) :] = torch.tensor(it.context)
        mask_BT[b, lc - len(it.context) :] = 1
    ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    cache, last_BV = _prefill(model, ids_BT, mask_BT=mask_BT, pos_BT=pos_BT, limits=limits)
    first_BV = torch.log_softmax(_upcast(last_BV[:, :vocab]), dim=-1)  # [B, V]: small
    first_C = torch.tensor([c[0] for c in conts], device=device)
    total_C += first_BV[owner_C, first_C].double()
    misses_C += (first_BV.argmax(-1)[owner_C] != first_C).long()
    if max(len(c) for c in conts) > 1:
        cache.batch_select_indices(owner_C)
        _feed(
            model,
            cache,
            base_mask_CK=mask_BT[owner_C],
            base_len_C=mask_BT.sum(-1)[owner_C],
            seqs=conts,
            starts=[1] * len(conts),  # the first token was scored from the prefill's logits
            limits=limits,
            vocab=vocab,
            acc=(total_C, misses_C),
        )
    return total_C.tolist(), misses_C.tolist()
