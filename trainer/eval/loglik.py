"""Log-likelihood scoring of continuations: tokenization as lm-eval does it, then the engine.

One ``ScoreItem`` is a context and one or more continuations (the answer texts of a multiple
choice question, a gold solution, a window of text). ``encode_pair`` tokenizes a (context,
continuations) pair the way lm-eval does; ``score_items`` runs the batches ``engine`` plans (each
context, or each few-shot prefix, computed once) and returns, per continuation, its summed
log-probability, token count and whether every token was the greedy choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from trainer.eval.engine import (
    BatchLimits,
    ModelDoesNotFitError,
    forward_checked,
    plan_batches,
    score_batch,
)

__all__ = ["BatchLimits", "ModelDoesNotFitError", "forward_checked", "score_items", "text_encoder"]


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
    """Adapter over a HF tokenizer (preferred) or a ``tokenbridge.tokenizers.Tokenizer``.

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
            for plan in plan_batches(items, limits):
                batch = [items[i] for i in plan.items]
                total, misses = score_batch(
                    model, batch, plan, limits=limits, device=device, vocab=vocab_size
                )
                j = 0
                for i, it in zip(plan.items, batch):
                    n = len(it.continuations)
                    results[i] = [
                        ChoiceScore(total[j + k], len(c), misses[j + k] == 0)
                        for k, c in enumerate(it.continuations)
                    ]
                    j += n
                bar.update(len(batch))
    finally:
        model.train(was_training)
        bar.close()
    return results  # type: ignore[return-value]


def nats_to_bits(nats: float) -> float:
    return nats / math.log(2)
