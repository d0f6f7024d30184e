"""The Numba kernels behind `tokenbridge.alignment.window_batch`: the windows of a whole batch in one call.

`cut_kernel` does per row what `tokenbridge.alignment.windows.cut_windows` does per document,
writing token ranges per window rather than arrays: the reference's per-window numpy calls cost
70-100 us per short document, more than tokenizing it. A row may be a piece of a long document
(`start_byte`, `final_byte`: docs/alignment.md, "Long documents"). Side 0 is the student, side
i + 1 teacher i, whose chunk arrays sit at offset ``c_base[i]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# per-row status
OK, NO_TOKENS, UNCUTTABLE, BAD_CHUNKS = 0, 1, 2, 3


@njit(cache=True, nogil=True)
def _pair_points(c_send, c_tend, c_bend, c0, c1, n_s, n_t, n_bytes, pos, sidx, tidx, cidx):
    """Candidate cut points of one pair in one row: the row start, every trusted chunk end, the
    row end; at one byte position the later entry wins. Returns their count, -1 if chunk ends
    go backwards (an alignment this cutter cannot trust)."""
    pos[0] = 0
    sidx[0] = 0
    tidx[0] = 0
    cidx[0] = 0
    m = 1
    for c in range(c0, c1):
        p = c_bend[c]
        if p < 0:
            continue  # inside a DP-fallback region: no trusted position
        if p < pos[m - 1] or p > n_bytes:
            return -1
        if p > pos[m - 1]:
            m += 1
        pos[m - 1] = p
        sidx[m - 1] = c_send[c]
        tidx[m - 1] = c_tend[c]
        cidx[m - 1] = c - c0 + 1
    if n_bytes > pos[m - 1]:
        m += 1
    pos[m - 1] = n_bytes
    sidx[m - 1] = n_s
    tidx[m - 1] = n_t
    cidx[m - 1] = c1 - c0
    return m


@njit(cache=True, nogil=True)
def _furthest(idx, k_max, a, budget):
    """Largest k <= k_max with idx[k] - idx[a] <= budget (idx non-decreasing)."""
    want = idx[a] + budget
    lo = a
    hi = k_max + 1  # idx[lo] <= want < idx[hi] (hi = k_max + 1: past the end)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if idx[mid] <= want:
            lo = mid
        else:
            hi = mid
    return lo


@njit(cache=True, nogil=True)
def cut_kernel(text_u8, byte_splits, s_splits, t_splits, c_splits, c_send, c_tend, c_bend,
               c_base, room, eos_add, stride, start_byte, final_byte, doc_end, drop_on_error,
               row_ok):  # fmt: skip
    """Windows of every row. room[side]: tokens of text a window may hold (the limit minus a
    BOS); eos_add[side]: 1 if the document's last window adds an EOS; stride: chars, <= 0 none.

    Returns (per window) row, byte/char start and end (row-relative), token ranges [sides, W] and
    an EOS flag; (per row) status, window splits, the next piece's start (byte, char; -1 when
    done), the first uncut span (chars) with each side's need, skipped spans, and the kept
    chunk and token ranges (for statistics).
    """
    n_rows = byte_splits.size - 1
    n_t = t_splits.shape[0]
    n_sides = n_t + 1
    cap = 0
    max_c = 0
    for b in range(n_rows):
        k = c_splits[0, b + 1] - c_splits[0, b] + 2
        cap += k
        for i in range(n_t):
            max_c = max(max_c, c_splits[i, b + 1] - c_splits[i, b] + 2)
    w_row = np.empty(cap, np.int64)
    w_bytes = np.empty((2, cap), np.int64)
    w_chars = np.empty((2, cap), np.int64)
    w_lo = np.empty((n_sides, cap), np.int64)
    w_hi = np.empty((n_sides, cap), np.int64)
    w_eos = np.zeros(cap, np.bool_)
    status = np.zeros(n_rows, np.int8)
    win_splits = np.zeros(n_rows + 1, np.int64)
    next_pos = np.full((2, n_rows), -1, np.int64)
    err_chars = np.full((2, n_rows), -1, np.int64)
    err_need = np.zeros((n_sides, n_rows), np.int64)
    skipped = np.zeros(n_rows, np.int64)
    kept_chunks = np.zeros((2, n_t, n_rows), np.int64)
    kept_tokens = np.zeros((2, n_sides, n_rows), np.int64)
    seam_moved = np.zeros(n_rows, np.bool_)
    # scratch: each pair's candidates, then the common cut points
    p_pos = np.empty((n_t, max_c), np.int64)
    p_s = np.empty((n_t, max_c), np.int64)
    p_t = np.empty((n_t, max_c), np.int64)
    p_c = np.empty((n_t, max_c), np.int64)
    p_m = np.zeros(n_t, np.int64)
    at = np.zeros(n_t, np.int64)
    bpos = np.empty(max_c, np.int64)
    chars = np.empty(max_c, np.int64)
    idx = np.empty((n_sides, max_c), np.int64)
    cc = np.empty((n_t, max_c), np.int64)
    w = 0
    for b in range(n_rows):
        win_splits[b] = w
        if not row_ok[b]:
            win_splits[b + 1] = w
            continue
        b0 = byte_splits[b]
        n_bytes = byte_splits[b + 1] - b0
        n_s = s_splits[b + 1] - s_splits[b]
        empty = n_s == 0
        bad = False
        for i in range(n_t):
            nt = t_splits[i, b + 1] - t_splits[i, b]
            empty = empty and nt == 0
            c0 = c_base[i] + c_splits[i, b]
            c1 = c_base[i] + c_splits[i, b + 1]
            p_m[i] = _pair_points(c_send, c_tend, c_bend, c0, c1, n_s, nt, n_bytes, p_pos[i],
                                  p_s[i], p_t[i], p_c[i])  # fmt: skip
            bad = bad or p_m[i] < 0
        if empty:
            status[b] = NO_TOKENS
            win_splits[b + 1] = w
            continue
        if bad:
            status[b] = BAD_CHUNKS
            win_splits[b + 1] = w
            continue
        # common positions of every pair (a merge over sorted lists), on a character boundary,
        # where every pair agrees on the student token there (zero-width chunks may not)
        at[:] = 0
        k_n = 0
        n_chars = 0
        scanned = 0
        while at[0] < p_m[0]:
            p = p_pos[0, at[0]]
            common = True
            for i in range(1, n_t):
                while at[i] < p_m[i] and p_pos[i, at[i]] < p:
                    at[i] += 1
                if at[i] >= p_m[i] or p_pos[i, at[i]] != p:
                    common = False
            if common and (p == n_bytes or (text_u8[b0 + p] & 0xC0) != 0x80):
                s0 = p_s[0, at[0]]
                for i in range(1, n_t):
                    common = common and p_s[i, at[i]] == s0
            elif common:
                common = False
            if common:
                while scanned < p:  # characters before p: bytes that start a character
                    n_chars += (text_u8[b0 + scanned] & 0xC0) != 0x80
                    scanned += 1
                bpos[k_n] = p
                chars[k_n] = n_chars
                idx[0, k_n] = p_s[0, at[0]]
                for i in range(n_t):
                    idx[i + 1, k_n] = p_t[i, at[i]]
                    cc[i, k_n] = p_c[i, at[i]]
                k_n += 1
            at[0] += 1
        last = k_n - 1
        # where windows start: the cut point at start_byte, else the nearest one before it
        a = 0
        while a < last and bpos[a + 1] <= start_byte[b]:
            a += 1
        seam_moved[b] = bpos[a] != start_byte[b]
        first_a = a
        last_k = a
        while a < last:
            k = last
            for s in range(n_sides):
                k = min(k, _furthest(idx[s], last, a, room[s]))
            if k == last and doc_end[b]:
                for s in range(n_sides):
                    if idx[s, last] - idx[s, a] + eos_add[s] > room[s]:
                        k = last - 1
            if k <= a:  # no cut point fits after a: real only if a + 1 is trusted
                if bpos[a + 1] > final_byte[b]:
                    break
                if skipped[b] == 0:
                    err_chars[0, b] = chars[a]
                    err_chars[1, b] = chars[a + 1]
                    for s in range(n_sides):
                        err_need[s, b] = idx[s, a + 1] - idx[s, a]
                skipped[b] += 1
                if drop_on_error[b]:
                    status[b] = UNCUTTABLE
                    w = win_splits[b]
                    break
                a += 1
                continue
            final = (k == last and doc_end[b]) or (k < last and bpos[k + 1] <= final_byte[b])
            if not final:
                break
            w_row[w] = b
            w_bytes[0, w] = bpos[a]
            w_bytes[1, w] = bpos[k]
            w_chars[0, w] = chars[a]
            w_chars[1, w] = chars[k]
            for s in range(n_sides):
                w_lo[s, w] = idx[s, a]
                w_hi[s, w] = idx[s, k]
            w_eos[w] = k == last
            w += 1
            last_k = k
            if k == last:
                a = last
                break
            nxt = k
            if stride > 0:
                want = chars[a] + stride
                j = a + 1
                while j < k and chars[j] < want:
                    j += 1
                nxt = j
            a = nxt
        win_splits[b + 1] = w
        if a < last:
            next_pos[0, b] = bpos[a]
            next_pos[1, b] = chars[a]
        for i in range(n_t):
            kept_chunks[0, i, b] = cc[i, first_a]
            kept_chunks[1, i, b] = cc[i, last_k]
        for s in range(n_sides):
            kept_tokens[0, s, b] = idx[s, first_a]
            kept_tokens[1, s, b] = idx[s, last_k]
    return (w_row[:w], w_bytes[:, :w], w_chars[:, :w], w_lo[:, :w], w_hi[:, :w], w_eos[:w],
            status, win_splits, next_pos, err_chars, err_need, skipped, kept_chunks, kept_tokens,
            seam_moved)  # fmt: skip


@njit(cache=True, nogil=True)
def gather_lists(values, row_base, w_row, lo, hi, head, has_head, tail, has_tail, w_tail, shift,
                 renumber):  # fmt: skip
    """One list column: window j holds [head] + values[row_base[row] + lo : ... + hi] + [tail].

    The head goes first in every window if `has_head`, the tail last where `has_tail` and
    w_tail[j]; with `renumber`, values >= 0 become value - shift[j] (chunk ids counted from 0
    per window) and negative ones stay -1. Returns (offsets int32 [W + 1], values int32).
    """
    n_w = w_row.size
    offsets = np.zeros(n_w + 1, np.int32)
    total = 0
    for j in range(n_w):
        total += hi[j] - lo[j] + has_head + (has_tail and w_tail[j])
        offsets[j + 1] = total
    out = np.empty(total, np.int32)
    o = 0
    for j in range(n_w):
        if has_head:
            out[o] = head
            o += 1
        base = row_base[w_row[j]]
        sh = shift[j]
        for k in range(base + lo[j], base + hi[j]):
            v = values[k]
            if renumber:
                v = v - sh if v >= 0 else -1
            out[o] = v
            o += 1
        if has_tail and w_tail[j]:
            out[o] = tail
            o += 1
    return offsets, out


@njit(cache=True, nogil=True)
def chunk_shift(chunk, row_base, w_row, lo, hi):
    """Per window: (first chunk id in it, number of chunks) from one pair's per-student-token
    chunk ids (monotone, -1 on tokens outside any chunk); (0, 0) for a window with none."""
    n_w = w_row.size
    first = np.zeros(n_w, np.int64)
    count = np.zeros(n_w, np.int32)
    for j in range(n_w):
        base = row_base[w_row[j]]
        f = -1
        g = -1
        for k in range(base + lo[j], base + hi[j]):
            if chunk[k] >= 0:
                f = chunk[k]
                break
        for k in range(base + hi[j] - 1, base + lo[j] - 1, -1):
            if chunk[k] >= 0:
                g = chunk[k]
                break
        if f >= 0:
            first[j] = f
            count[j] = g - f + 1
    return first, count


@njit(cache=True, nogil=True)
def gather_bytes(data, row_base, w_row, start, end):
    """Window texts as one UTF-8 buffer + int32 offsets (an Arrow string column)."""
    n_w = w_row.size
    offsets = np.zeros(n_w + 1, np.int32)
    total = 0
    for j in range(n_w):
        total += end[j] - start[j]
        offsets[j + 1] = total
    out = np.empty(total, np.uint8)
    o = 0
    for j in range(n_w):
        base = row_base[w_row[j]]
        n = end[j] - start[j]
        out[o : o + n] = data[base + start[j] : base + end[j]]
        o += n
    return offsets, out
