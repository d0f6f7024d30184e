"""Batched log-likelihood scoring of continuations, each shared context run once.

One ``ScoreItem`` is a context and one or more continuations (the answer texts of a multiple
choice question). A batch of items is scored in two passes over the model:

1. the contexts, left-padded to one length, filling a KV cache (only the last position's logits
   are computed: it predicts the first token of every continuation);
2. the cache rows repeated once per continuation, then the continuations (right-padded) fed on
   top of it; logits only at real continuation positions (``logits_to_keep`` as a boolean mask).

Both passes run in segments along the sequence, so activations stay within ``max_tokens`` and
the [N, V] logits block within ``max_logits`` however long a context or a gold answer is. Left
padding keeps each row's real tokens contiguous at the right end of the cache, which is what a
sliding-window layer (Gemma 3) needs to see the same keys as in an unpadded forward.

Tensor legend: B contexts in a batch, C continuations in a batch, T positions, V vocabulary,
N kept (scored) positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


class ModelDoesNotFitError(MemoryError):
    """The model (or a batch) does not fit in the device's memory; the message says what to try."""


@dataclass(frozen=True)
class TextEncoder:
    """How the scorer turns text into ids: no special tokens, plus what starts a sequence."""

    encode_batch: Callable[[list[str]], list[list[int]]]
    prefix: tuple[int, ...]  # what the tokenizer puts before a text by default (e.g. BOS), or ()
    doc_start: int  # the token a document's first token is predicted from (BPB)
    decode: Callable[[list[int]], str] | None = None
    eos_id: int | None = None
    vocab_size: int | None = None  # ids the tokenizer can emit; lm_head columns past it are
    # padding, left out of the softmax (as the trainer's losses do)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]


def text_encoder(tokenizer) -> TextEncoder:
    """Adapter over a HF tokenizer (preferred) or a ``pipelines.tokenizer.Tokenizer``.

    A HF tokenizer keeps its own default of special tokens (Gemma adds <bos>, SmolLM2 nothing),
    as lm-eval does; a text scored from its start is predicted from that BOS, or from the BOS
    (else EOS) token when the tokenizer adds none.
    """
    if isinstance(tokenizer, TextEncoder):
        return tokenizer
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # transformers tokenizer

        def encode_batch(texts: list[str]) -> list[list[int]]:
            if not texts:
                return []
            return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]]

        plain, full = encode_batch(["a"])[0], list(tokenizer("a")["input_ids"])
        prefix: tuple[int, ...] = ()
        for k in range(len(full) - len(plain) + 1):
            if full[k : k + len(plain)] == plain:
                prefix = tuple(full[:k])
                break
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        decode, vocab = tokenizer.decode, len(tokenizer)
    elif hasattr(tokenizer, "encode") and hasattr(tokenizer, "bos_id"):  # pipelines Tokenizer

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [tokenizer.encode(t).ids.tolist() for t in texts]

        bos, eos, decode = tokenizer.bos_id, tokenizer.eos_id, tokenizer.decode
        prefix = () if bos is None else (bos,)
        vocab = tokenizer.vocab_size
    else:
        raise TypeError(f"not a tokenizer: {type(tokenizer).__name__}")
    start = prefix[-1] if prefix else (bos if bos is not None else eos)
    if start is None:
        raise ValueError("tokenizer has neither BOS nor EOS: pass a TextEncoder with doc_start")
    return TextEncoder(encode_batch, prefix, int(start), decode, eos, vocab)


@dataclass
class ScoreItem:
    context: list[int]  # non-empty
    continuations: list[list[int]]  # each non-empty


@dataclass(frozen=True)
class ChoiceScore:
    logprob: float  # summed natural-log probability of the continuation's tokens
    num_tokens: int
    greedy: bool  # every continuation token was the argmax


@dataclass
class TokenStats:
    """Counted, never silent: contexts cut from the left, boundaries re-tokenized, skips."""

    context_truncated: int = 0
    boundary_retokenized: int = 0
    skipped_too_long: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def encode_pair(
    enc: TextEncoder, context: str, continuations: list[str], *, max_length: int, stats: TokenStats
) -> ScoreItem | None:
    """Token ids of a context and its continuations, as lm-eval splits them.

    Trailing whitespace of the context moves to the continuations; a continuation's ids are the
    tail of encode(context + continuation) after encode(context) (so the boundary is tokenized
    as in running text), or encode(continuation) when the joint encoding does not start with the
    context's ids (counted). Too long: the context loses tokens from the left (counted); a
    continuation that alone exceeds ``max_length`` skips the item (counted, returns None).
    """
    n_ws = len(context) - len(context.rstrip())
    if n_ws and context.strip():
        continuations = [context[-n_ws:] + c for c in continuations]
        context = context[:-n_ws]
    ctx, *wholes = enc.encode_batch([context, *(context + c for c in continuations)])
    conts = []
    for cont_text, whole in zip(continuations, wholes):
        if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
            conts.append(whole[len(ctx) :])
        else:
            stats.boundary_retokenized += 1
            conts.append(enc.encode(cont_text))
        if not conts[-1]:
            raise ValueError(f"empty continuation {cont_text!r} after context {context[-40:]!r}")
    ctx = [*enc.prefix, *ctx] if (enc.prefix or ctx) else [enc.doc_start]
    longest = max(len(c) for c in conts)
    if longest >= max_length:
        stats.skipped_too_long += 1
        return None
    if len(ctx) + longest > max_length:
        stats.context_truncated += 1
        ctx = ctx[len(ctx) + longest - max_length :]
    return ScoreItem(ctx, conts)


@dataclass(frozen=True)
class BatchLimits:
    max_items: int = 16  # contexts per batch
    max_tokens: int = 2048  # padded tokens per forward
    max_logits: int = 2**26  # elements of one float32 [N, V] logits block (256 MiB)
    cache_tokens: int = field(default=0)  # rows x length of the repeated KV cache; 0 = 4x tokens

    def cache_limit(self) -> int:
        return self.cache_tokens or 4 * self.max_tokens


def plan_batches(items: list[ScoreItem], limits: BatchLimits) -> list[list[int]]:
    """Groups of item indices, longest first (OOM shows early), similar lengths together."""

    def length(i: int) -> int:
        return len(items[i].context) + max(len(c) for c in items[i].continuations)

    batches: list[list[int]] = []
    cur: list[int] = []
    lc = lm = k = 0
    for i in sorted(range(len(items)), key=lambda i: -length(i)):
        it = items[i]
        nlc = max(lc, len(it.context))
        nlm = max(lm, max(len(c) for c in it.continuations))
        nk = k + len(it.continuations)
        cost = (len(cur) + 1) * nlc + nk * nlm
        over = cost > limits.max_tokens or nk * (nlc + nlm) > limits.cache_limit()
        if cur and (over or len(cur) >= limits.max_items):
            batches.append(cur)
            cur = []
            nlc, nlm = len(it.context), max(len(c) for c in it.continuations)
            nk = len(it.continuations)
        cur.append(i)
        lc, lm, k = nlc, nlm, nk
    if cur:
        batches.append(cur)
    return batches


def _vocab_width(model) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight"):
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def forward_checked(model, **kw):
    try:
        return model(use_cache=True, **kw)
    except torch.OutOfMemoryError as e:
        raise ModelDoesNotFitError(
            f"out of device memory in a forward of {tuple(kw['input_ids'].shape)} tokens: "
            "lower --batch-size/--batch-tokens, use --dtype bfloat16, or --device cpu"
        ) from e
    except RuntimeError as e:
        if "memory" in str(e).lower() and "allocat" in str(e).lower():
            raise ModelDoesNotFitError(
                f"out of host memory ({e}); lower --batch-size/--batch-tokens"
            ) from e
        raise


def _score_batch(
    model, items: list[ScoreItem], limits: BatchLimits, device, vocab: int | None
) -> list[list[ChoiceScore]]:
    n_ctx = len(items)
    lc = max(len(it.context) for it in items)
    ctx_BT = torch.zeros(n_ctx, lc, dtype=torch.long)
    mask_BT = torch.zeros(n_ctx, lc, dtype=torch.long)
    for b, it in enumerate(items):
        ctx_BT[b, lc - len(it.context) :] = torch.tensor(it.context)
        mask_BT[b, lc - len(it.context) :] = 1
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    ctx_BT, mask_BT, pos_BT = ctx_BT.to(device), mask_BT.to(device), pos_BT.to(device)

    cache, seg = None, max(1, limits.max_tokens // n_ctx)
    for s in range(0, lc, seg):
        e = min(lc, s + seg)
        out = forward_checked(
            model,
            input_ids=ctx_BT[:, s:e],
            attention_mask=mask_BT[:, :e],
            position_ids=pos_BT[:, s:e],
            past_key_values=cache,
            logits_to_keep=1,
        )
        cache = out.past_key_values
    first_BV = torch.log_softmax(out.logits[:, -1, :vocab].float(), dim=-1)  # [B, V]: small

    owner = [b for b, it in enumerate(items) for _ in it.continuations]
    conts = [c for it in items for c in it.continuations]
    n_c = len(conts)
    owner_C = torch.tensor(owner, device=device)
    first_C = torch.tensor([c[0] for c in conts], device=device)
    total_C = first_BV[owner_C, first_C].double()
    misses_C = (first_BV.argmax(-1)[owner_C] != first_C).long()

    lm = max(len(c) for c in conts) - 1  # inputs are cont[:-1], targets cont[1:]
    if lm > 0:
        cache.batch_select_indices(owner_C)
        inp_CT = torch.zeros(n_c, lm, dtype=torch.long)
        tgt_CT = torch.zeros(n_c, lm, dtype=torch.long)
        real_CT = torch.zeros(n_c, lm, dtype=torch.long)
        for j, c in enumerate(conts):
            inp_CT[j, : len(c) - 1] = torch.tensor(c[:-1])
            tgt_CT[j, : len(c) - 1] = torch.tensor(c[1:])
            real_CT[j, : len(c) - 1] = 1
        inp_CT, tgt_CT, real_CT = inp_CT.to(device), tgt_CT.to(device), real_CT.to(device)
        pos_CT = mask_BT.sum(-1)[owner_C][:, None] + torch.arange(lm, device=device)
        ctx_mask_CT = mask_BT[owner_C]
        width = _vocab_width(model)
        seg = max(1, min(limits.max_tokens // n_c, limits.max_logits // (n_c * width)))
        for s in range(0, lm, seg):
            e = min(lm, s + seg)
            keep_CT = real_CT[:, s:e].bool()
            if not keep_CT.any():
                break
            out = forward_checked(
                model,
                input_ids=inp_CT[:, s:e],
                attention_mask=torch.cat([ctx_mask_CT, real_CT[:, :e]], dim=1),
                position_ids=pos_CT[:, s:e],
                past_key_values=cache,
                logits_to_keep=keep_CT,
            )
            cache = out.past_key_values
            # log p = logit - logsumexp: no second [N, V] tensor for a full log-softmax
            logits_NV = out.logits.reshape(-1, out.logits.shape[-1])[:, :vocab].float()
            tgt_N = tgt_CT[:, s:e][keep_CT]
            rows_N = keep_CT.nonzero()[:, 0]  # same row-major order as the kept logits
            logp_N = logits_NV.gather(1, tgt_N[:, None])[:, 0] - torch.logsumexp(logits_NV, -1)
            total_C.index_add_(0, rows_N, logp_N.double())
            misses_C.index_add_(0, rows_N, (logits_NV.argmax(-1) != tgt_N).long())
    total, misses = total_C.tolist(), misses_C.tolist()
    scores, j = [], 0
    for it in items:
        row = []
        for c in it.continuations:
            row.append(ChoiceScore(total[j], len(c), misses[j] == 0))
            j += 1
        scores.append(row)
    return scores


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def score_items(
    model,
    items: list[ScoreItem],
    *,
    limits: BatchLimits | None = None,
    device=None,
    progress: bool | str = False,
    vocab_size: int | None = None,
) -> list[list[ChoiceScore]]:
    """Score every continuation of every item; results in the order of ``items``.

    ``vocab_size``: softmax over the first columns only (a padded lm_head's extra columns are
    not tokens). Runs under ``no_grad`` (not ``inference_mode``, which FSDP2 unsharding dislikes).
    """
    limits = limits or BatchLimits()
    device = device or model_device(model)
    results: list[list[ChoiceScore] | None] = [None] * len(items)
    desc = progress if isinstance(progress, str) else "scoring"
    bar = tqdm(total=len(items), desc=desc, disable=not progress, leave=False)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in plan_batches(items, limits):
                for i, res in zip(
                    batch,
                    _score_batch(model, [items[i] for i in batch], limits, device, vocab_size),
                ):
                    results[i] = res
                bar.update(len(batch))
    finally:
        model.train(was_training)
        bar.close()
    return results  # type: ignore[return-value]


def nats_to_bits(nats: float) -> float:
    return nats / math.log(2)
