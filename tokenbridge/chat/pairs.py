"""Chunks of one (student, teacher) pair over a batch of conversations, in flat arrays.

All contents of all conversations go through one call of the ordinary offset aligner; turn
markers are paired by message around them, so message k's chunks are ``[open pair] [text
chunks] [end-of-turn pair]`` on both sides, and chunk ids stay non-decreasing with every id on
both sides. Tokens that cross a content's edge get chunk -1 and are counted (`PairBatch.loose`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.alignment.chunks import align_flat
from tokenbridge.chat.encode import RenderedBatch
from tokenbridge.chat.markers import Layout, fill_ranges, token_ranges
from tokenbridge.formats.shard_schema import CHUNK_EOT, CHUNK_OPEN


@dataclass(frozen=True)
class PairBatch:
    """Chunks of one (student, teacher) pair; conversation b owns chunks
    [chunk_splits[b], chunk_splits[b + 1]) of the per-chunk arrays. Chunk ids in the per-token
    arrays count from 0 in every conversation."""

    student_chunk: np.ndarray  # int32 [N_s], -1 = no chunk
    teacher_chunk: np.ndarray  # int32 [N_t]
    chunk_splits: np.ndarray  # int64 [B + 1]
    chunk_kind: np.ndarray  # int8 [C]: aligner kinds 0..3 (text), CHUNK_OPEN, CHUNK_EOT
    chunk_message: np.ndarray  # int32 [C]: message index within the conversation
    chunk_exact: np.ndarray  # bool [C]
    fallback_regions: np.ndarray  # int32 [B]: DP-fallback regions of the aligner
    loose: np.ndarray  # int32 [B]: tokens over text both sides contain, in no chunk (straddles)


def shared_spans(span_bytes: np.ndarray, cut: np.ndarray, other_cut: np.ndarray) -> np.ndarray:
    """int64 [M, 2]: each content's byte span in one side's rendering less the edge whitespace
    only the other side left out (`RenderedBatch.cut_bytes` of both): the text both contain."""
    lead = np.maximum(cut[:, 0], other_cut[:, 0]) - cut[:, 0]
    trail = np.maximum(cut[:, 1], other_cut[:, 1]) - cut[:, 1]
    a = np.minimum(span_bytes[:, 0] + lead, span_bytes[:, 1])
    return np.stack([a, np.maximum(span_bytes[:, 1] - trail, a)], axis=1)


def _shared(s: RenderedBatch, ls: Layout, t: RenderedBatch, lt: Layout):
    """Per side: (byte spans both sides contain, tokens overlapping them, tokens inside them).
    Usually no content lost whitespace on either side: the contents' own spans and ranges."""
    if not (s.cut_bytes.any() or t.cut_bytes.any()):
        return (s.span_bytes, ls.content, ls.inside), (t.span_bytes, lt.content, lt.inside)
    out = []
    for side, cut, other in ((s, s.cut_bytes, t.cut_bytes), (t, t.cut_bytes, s.cut_bytes)):
        span = shared_spans(side.span_bytes, cut, other)
        out.append((span, *token_ranges(side, span)))
    return out[0], out[1]


def _common_one(s: RenderedBatch, s_span, s_in, t: RenderedBatch, t_span, t_in, k: int):
    """(student range, teacher range, byte shift) of message k when a token straddles."""
    s0, s1 = (int(x) for x in s_in[k])
    t0, t1 = (int(x) for x in t_in[k])
    sb = s.byte_offsets[s0:s1] - s_span[k, 0]
    tb = t.byte_offsets[t0:t1] - t_span[k, 0]
    starts = np.intersect1d(sb[:, 0], tb[:, 0])
    ends = np.intersect1d(sb[:, 1], tb[:, 1])
    if not starts.size or not ends.size or ends[-1] <= starts[0]:
        return None
    a, b = int(starts[0]), int(ends[-1])
    ss = s0 + np.searchsorted(sb[:, 0], a), s0 + np.searchsorted(sb[:, 1], b, side="right")
    ts = t0 + np.searchsorted(tb[:, 0], a), t0 + np.searchsorted(tb[:, 1], b, side="right")
    return int(ss[0]), int(ss[1]), int(ts[0]), int(ts[1]), a


def _common_ranges(s: RenderedBatch, s_span, si, t: RenderedBatch, t_span, ti):
    """Per message with text to align: (message, student [a0, a1), teacher [b0, b1), shift).
    s_span / t_span: the byte spans to align; si / ti: the tokens inside them."""
    nonempty = (si[:, 1] > si[:, 0]) & (ti[:, 1] > ti[:, 0])
    last_s, last_t = np.maximum(si[:, 1] - 1, 0), np.maximum(ti[:, 1] - 1, 0)
    tiles = (
        nonempty
        & (s.byte_offsets[np.minimum(si[:, 0], last_s), 0] == s_span[:, 0])
        & (t.byte_offsets[np.minimum(ti[:, 0], last_t), 0] == t_span[:, 0])
        & (s.byte_offsets[last_s, 1] == s_span[:, 1])
        & (t.byte_offsets[last_t, 1] == t_span[:, 1])
    ) if si.size else nonempty  # fmt: skip
    msg = np.flatnonzero(tiles)
    a0, a1, b0, b1 = si[msg, 0], si[msg, 1], ti[msg, 0], ti[msg, 1]
    shift = np.zeros(msg.size, np.int64)
    slow = [(k, r) for k in np.flatnonzero(nonempty & ~tiles).tolist()
            if (r := _common_one(s, s_span, si, t, t_span, ti, k)) is not None]  # fmt: skip
    if slow:
        extra = np.array([(k, *r) for k, r in slow], np.int64)
        msg = np.concatenate([msg, extra[:, 0]])
        a0, a1 = np.concatenate([a0, extra[:, 1]]), np.concatenate([a1, extra[:, 2]])
        b0, b1 = np.concatenate([b0, extra[:, 3]]), np.concatenate([b1, extra[:, 4]])
        shift = np.concatenate([shift, extra[:, 5]])
        order = np.argsort(msg, kind="stable")
        msg, a0, a1, b0, b1, shift = (x[order] for x in (msg, a0, a1, b0, b1, shift))
    return msg, a0, a1, b0, b1, shift


def _gather(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices of ranges [lo, hi) in order, and row splits."""
    lens = hi - lo
    splits = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=splits[1:])
    idx = np.repeat(lo - splits[:-1], lens) + np.arange(int(splits[-1]))
    return idx, splits


def align_pair(
    s: RenderedBatch, ls: Layout, t: RenderedBatch, lt: Layout, *, student_bytes, teacher_bytes
) -> PairBatch:
    """All chunks of one pair over a batch (module docstring)."""
    n_conv, n_msg = len(s), s.span_bytes.shape[0]
    (s_span, s_over, s_in), (t_span, t_over, t_in) = _shared(s, ls, t, lt)
    msg, a0, a1, b0, b1, shift = _common_ranges(s, s_span, s_in, t, t_span, t_in)
    s_idx, s_splits = _gather(a0, a1)
    t_idx, t_splits = _gather(b0, b1)
    s_row = np.repeat(np.arange(msg.size), np.diff(s_splits))
    t_row = np.repeat(np.arange(msg.size), np.diff(t_splits))
    res = align_flat(
        student_ids=s.ids[s_idx],
        student_byte_offsets=s.byte_offsets[s_idx] - (s_span[msg, 0] + shift)[s_row, None],
        student_splits=s_splits,
        teacher_ids=t.ids[t_idx],
        teacher_byte_offsets=t.byte_offsets[t_idx] - (t_span[msg, 0] + shift)[t_row, None],
        teacher_splits=t_splits,
        student_lossless=np.logical_and.reduceat(s.lossless[s_idx], s_splits[:-1])
        if s_idx.size else np.ones(msg.size, bool),
        teacher_lossless=np.logical_and.reduceat(t.lossless[t_idx], t_splits[:-1])
        if t_idx.size else np.ones(msg.size, bool),
        student_bytes=student_bytes,
        teacher_bytes=teacher_bytes,
    )  # fmt: skip

    # per message: [open] [text chunks] [eot] block sizes and where each block starts
    has_open = (ls.open >= 0) & (lt.open >= 0)
    has_eot = (ls.close[:, 0] >= 0) & (lt.close[:, 0] >= 0)
    n_text = np.zeros(n_msg, np.int64)
    n_text[msg] = np.diff(res.chunk_splits)
    block = has_open + n_text + has_eot
    cum = np.zeros(n_msg + 1, np.int64)
    np.cumsum(block, out=cum[1:])
    chunk_splits = cum[s.span_splits]
    msg_row = np.repeat(np.arange(n_conv), np.diff(s.span_splits))
    base = cum[:-1] - chunk_splits[msg_row]  # first chunk id of message k's block

    s_chunk = np.full(s.ids.size, -1, np.int32)
    t_chunk = np.full(t.ids.size, -1, np.int32)
    s_chunk[ls.open[has_open]] = base[has_open]
    t_chunk[lt.open[has_open]] = base[has_open]
    text0 = (base + has_open)[msg]  # id of each row's first text chunk
    s_chunk[s_idx] = np.where(res.student_chunk >= 0, res.student_chunk + text0[s_row], -1)
    t_chunk[t_idx] = np.where(res.teacher_chunk >= 0, res.teacher_chunk + text0[t_row], -1)
    eot = base + has_open + n_text
    fill_ranges(ls.close[has_eot, 0], ls.close[has_eot, 1], eot[has_eot], s_chunk)
    fill_ranges(lt.close[has_eot, 0], lt.close[has_eot, 1], eot[has_eot], t_chunk)

    n_chunks = int(cum[-1])
    kind = np.zeros(n_chunks, np.int8)
    exact = np.ones(n_chunks, bool)
    kind[cum[:-1][has_open]] = CHUNK_OPEN
    kind[(cum[:-1] + has_open + n_text)[has_eot]] = CHUNK_EOT
    c_row = np.repeat(np.arange(msg.size), np.diff(res.chunk_splits))
    at = (cum[:-1] + has_open)[msg][c_row] + np.arange(c_row.size) - res.chunk_splits[c_row]
    kind[at] = res.chunk_kind
    exact[at] = res.chunk_exact
    local = np.arange(n_msg) - s.span_splits[msg_row]
    chunk_message = np.repeat(local, block).astype(np.int32)

    fallback = np.bincount(msg_row[msg], weights=res.fallback_regions, minlength=n_conv)
    loose = np.zeros(n_conv, np.int64)
    for side, over, chunk in ((s, s_over, s_chunk), (t, t_over, t_chunk)):
        tok_row = np.repeat(np.arange(n_conv), np.diff(side.token_splits))
        shared = np.zeros(chunk.size, bool)  # tokens over text both sides contain
        fill_ranges(over[:, 0], over[:, 1], True, shared)
        loose += np.bincount(tok_row[shared & (chunk < 0)], minlength=n_conv)
    return PairBatch(s_chunk, t_chunk, chunk_splits, kind, chunk_message, exact,
                     fallback.astype(np.int32), loose.astype(np.int32))  # fmt: skip
