"""Held-out bits per byte: the metric that compares models with different tokenizers.

Every token of a text is scored exactly once (long texts in overlapping windows), so the
denominator is the text's own UTF-8 byte count whatever the tokenizer; `trained_bpb` counts only
the trained contents of conversation rows. The raw sums are returned too, for a data-parallel
all-reduce before dividing (docs/eval.md, "Bits per byte").
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tokenbridge.formats.shard_schema import TRAIN_CONTENT
from trainer.eval.loglik import BatchLimits, ScoreItem, TextEncoder, score_items, text_encoder


def text_windows(
    enc: TextEncoder, ids: list[int], *, max_length: int, overlap: int = 0
) -> list[ScoreItem]:
    """Score items covering every token of ``ids`` once (the start token is context only)."""
    if max_length < 2 or not 0 <= overlap <= max_length - 2:
        raise ValueError(
            f"need max_length >= 2 and 0 <= overlap <= max_length - 2, got {max_length}, {overlap}"
        )
    start = list(enc.prefix) or [enc.doc_start]
    full = start + list(ids)
    items, a = [], len(start)
    while a < len(full):
        ctx = full[: len(start)] if a == len(start) else full[max(0, a - 1 - overlap) : a]
        b = min(len(full), a + max_length - len(ctx))
        items.append(ScoreItem(ctx, [full[a:b]]))
        a = b
    return items


def score_texts(
    model,
    tokenizer,
    texts: list[str],
    *,
    max_length: int = 1024,
    overlap: int = 0,
    limits: BatchLimits | None = None,
    device=None,
    progress: bool | str = False,
) -> dict[str, list]:
    """Per text: summed nats, UTF-8 bytes, tokens and windows (lists aligned with ``texts``)."""
    enc = text_encoder(tokenizer)
    items: list[ScoreItem] = []
    owner: list[int] = []
    tokens = []
    for t, ids in enumerate(enc.encode_batch(list(texts))):
        windows = text_windows(enc, ids, max_length=max_length, overlap=overlap)
        items += windows
        owner += [t] * len(windows)
        tokens.append(len(ids))
    scores = score_items(
        model, items, limits=limits, device=device, progress=progress, vocab_size=enc.vocab_size
    )
    nats = [0.0] * len(texts)
    windows = [0] * len(texts)
    for t, s in zip(owner, scores):
        nats[t] -= s[0].logprob
        windows[t] += 1
    nbytes = [len(t.encode("utf-8")) for t in texts]
    return {"nats": nats, "bytes": nbytes, "tokens": tokens, "windows": windows}


def evaluate_bpb(
    model,
    tokenizer,
    texts: list[str],
    *,
    batch_size: int = 8,
    device=None,
    max_length: int = 1024,
    overlap: int = 0,
    progress: bool | str = False,
) -> dict:
    """Bits per byte of ``texts`` under ``model``.

    Returns ``bpb``, ``bits_per_token``, and the sums ``nats``, ``bytes``, ``tokens``, plus
    ``texts`` and ``windows`` counts. ``tokenizer`` is the model's HF tokenizer (or a
    ``pipelines`` Tokenizer / ``TextEncoder``). The model is put in eval mode and restored.
    """
    if not texts:
        raise ValueError("evaluate_bpb needs at least one text")
    limits = BatchLimits(max_items=batch_size, max_tokens=batch_size * max_length)
    per = score_texts(
        model,
        tokenizer,
        texts,
        max_length=max_length,
        overlap=overlap,
        limits=limits,
        device=device,
        progress=progress,
    )
    nats, nbytes, ntok = sum(per["nats"]), sum(per["bytes"]), sum(per["tokens"])
    if nbytes == 0:
        raise ValueError("evaluate_bpb: the texts are empty (0 bytes)")
    return _result(nats, nbytes, ntok, texts=len(texts), windows=sum(per["windows"]))


def _result(nats: float, nbytes: int, ntok: int, *, texts: int, windows: int) -> dict:
    """The keys both evaluators return: bits per byte and per token, and the sums behind them."""
    return {
        "bpb": nats / (math.log(2) * nbytes),
        "bits_per_token": nats / (math.log(2) * max(ntok, 1)),
        "nats": nats,
        "bytes": nbytes,
        "tokens": ntok,
        "texts": texts,
        "windows": windows,
    }


@torch.no_grad()
def trained_bpb(
    model,
    rows: list[tuple[np.ndarray, np.ndarray, int]],
    *,
    vocab_size: int,
    batch_size: int = 2,
    device=None,
) -> dict:
    """Bits per byte of the trained contents of conversation rows (docs/eval.md,
    "Bits per byte"; docs/losses.md, "Conversations").

    ``rows``: (token ids, train codes, trained bytes) per row, one model's side of a shard row
    (`tokenbridge.formats.shard_schema`: ``student_ids`` / ``student_train`` / ``trained_bytes``, or a
    teacher's). Same keys as `evaluate_bpb`; ``tokens`` counts the scored content tokens.
    """
    from tokenbridge.losses.ce import ce

    if not rows:
        raise ValueError("trained_bpb needs at least one row")
    was_training = model.training
    model.eval()
    nats, n_tokens = 0.0, 0
    try:
        for b0 in range(0, len(rows), batch_size):
            part = rows[b0 : b0 + batch_size]
            width = max(len(ids) for ids, _, _ in part)
            ids = torch.zeros((len(part), width), dtype=torch.int64)
            targets = torch.full((len(part), width), -1, dtype=torch.int64)
            mask = torch.zeros((len(part), width), dtype=torch.int64)
            for i, (x, codes, _) in enumerate(part):
                n = len(x)
                ids[i, :n], mask[i, :n] = torch.as_tensor(np.asarray(x, np.int64)), 1
                content = torch.as_tensor(np.asarray(codes[1:]) == TRAIN_CONTENT)
                targets[i, : n - 1] = torch.where(content, ids[i, 1:n], -1)
            logits = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False
            ).logits
            out = ce(logits, targets.to(logits.device), vocab_size=vocab_size)
            nats += float(out.sum)
            n_tokens += int(out.count)
    finally:
        model.train(was_training)
    nbytes = sum(int(b) for _, _, b in rows)
    if nbytes == 0:
        raise ValueError("trained_bpb: the rows train on no content (0 bytes)")
    return _result(nats, nbytes, n_tokens, texts=len(rows), windows=len(rows))
