"""The Numba kernel behind `tokenbridge.alignment.chunks`: one call aligns a whole batch.

Per row, the clean path (both rows lossless, spans tile the text, no special or zero-width
token) checks, walks and labels in one branch-free pass; the general path marks untrusted tokens
(`_trust`), cuts regions at boundaries trusted on both sides (`_walk`), hands regions with an
untrusted token to the DP and labels the chunks (`_label_row`). Numba functions take positional
arguments only, hence the long signatures.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from tokenbridge.alignment.dp import dp_region_chunks

ERR_NO_TABLE = 1  # a row needs the DP fallback but no token byte table was given
META_SPECIAL = 1 << 15  # VocabBytes.meta: bit set on special tokens
LEN_CAP = (1 << 15) - 1  # VocabBytes.meta: longer tokens hold the cap, the check reads offsets

_BAD, _SPECIAL, _ZERO = 1, 2, 4  # per-token flags written by _trust


@njit(cache=True, nogil=True)
def _trust(ids, bo, lo, n, lossless, toff, meta, has_tab, tb, flags):
    """Per token k: flags[k] (_BAD: span untrusted, _SPECIAL, _ZERO: zero width) and tb[k], the
    trusted boundary before token k or -1. Returns (untrusted tokens, special or zero-width
    tokens): a row with neither takes the fused clean path.

    A token is good when it starts where everything before it ended and its span is as long as
    its bytes. The boundary before token k is trusted when the spans tile there and a good token
    vouches for it from either side.
    """
    max_end = 0
    prev_ok = True
    n_bad = 0
    n_special = 0
    n_zero = 0
    for k in range(n):
        st = bo[lo + k, 0]
        en = bo[lo + k, 1]
        tiles = st == max_end
        ok = tiles and en >= st
        f = _ZERO if en == st else 0
        n_zero += en == st
        if has_tab:
            t = ids[lo + k]
            mt = meta[t]
            if mt & META_SPECIAL:
                f |= _SPECIAL
                n_special += 1
            elif ok:
                length = mt if mt < LEN_CAP else toff[t + 1] - toff[t]
                ok = length == en - st
        elif not lossless:
            ok = False
        flags[k] = f if ok else f | _BAD
        n_bad += not ok
        tb[k] = st if tiles and (ok or prev_ok) else -1
        prev_ok = ok
        if en > max_end:
            max_end = en
    tb[0] = 0
    tb[n] = max_end
    return n_bad, n_special + n_zero


@njit(cache=True, nogil=True)
def _walk(tb_s, f_s, n, tb_t, f_t, m, reg):
    """Two-pointer walk over trusted boundaries; reg[r] = (student end, teacher end, byte end).

    Zero-width tokens sitting on a common boundary join the closing chunk, unless untrusted
    (a dummy-prefix space spanning nothing says nothing about where it belongs).
    """
    n_reg = 0
    ka = 1
    kb = 1
    while ka <= n and kb <= m:
        pa = tb_s[ka]
        if pa < 0:
            ka += 1
            continue
        pb = tb_t[kb]
        if pb < 0:
            kb += 1
            continue
        if pa < pb:
            ka += 1
        elif pb < pa:
            kb += 1
        else:  # a common boundary; zero-width tokens sitting on it join the closing chunk
            while ka < n and tb_s[ka + 1] == pa and not f_s[ka] & _BAD:
                ka += 1
            while kb < m and tb_t[kb + 1] == pa and not f_t[kb] & _BAD:
                kb += 1
            reg[n_reg, 0] = ka
            reg[n_reg, 1] = kb
            reg[n_reg, 2] = pa
            n_reg += 1
            ka += 1
            kb += 1
    return n_reg


@njit(cache=True, nogil=True)
def _same_bytes(u, v, s_off, s_data, t_off, t_data):
    """Token u of the student and token v of the teacher stand for the same bytes."""
    la = s_off[u + 1] - s_off[u]
    if la != t_off[v + 1] - t_off[v]:
        return False
    for p in range(la):  # noqa: SIM110 (a plain loop compiles to the tightest code)
        if s_data[s_off[u] + p] != t_data[t_off[v] + p]:
            return False
    return True


@njit(cache=True, nogil=True)
def _walk_label_clean(s_ids, s_bo, s_lo, n, s_meta, has_s, t_ids, t_bo, t_lo, m, t_meta, has_t,
                      s_chunk, t_chunk, kind, exact, c_send, c_tend, c_bend, c):  # fmt: skip
    """Check, walk and label a row in one branch-free pass, assuming it is clean.

    Clean: both rows lossless, every token starts where the previous one ended, is as long as
    its bytes (meta: byte length; specials carry META_SPECIAL and never match; without a byte
    table no token is known to be special) and is not zero-width. That is the common case, so
    it is fused: each step checks the token it moves past, labels the current token of both
    sides with the open chunk, rewrites the open chunk's record, closes it when the two token
    ends meet and advances the side(s) whose token ends first (a branchy merge mispredicts on
    about every other token). In a lossless row a 1:1 chunk's two tokens are the same text
    bytes, so `exact` is just "1:1". Returns the next chunk index, or -1 if the row is not clean
    or the sides do not reach a common end; the caller then takes the general path.
    """
    c_row = c
    i = 0
    j = 0
    a0 = 0
    b0 = 0
    end_s = 0  # end of the last token passed on each side
    end_t = 0
    bad = False
    while i < n and j < m:
        sa = s_bo[s_lo + i, 0]
        ea = s_bo[s_lo + i, 1]
        sb = t_bo[t_lo + j, 0]
        eb = t_bo[t_lo + j, 1]
        ok_s = sa == end_s and ea > sa and (not has_s or s_meta[s_ids[s_lo + i]] == ea - sa)
        ok_t = sb == end_t and eb > sb and (not has_t or t_meta[t_ids[t_lo + j]] == eb - sb)
        s_chunk[s_lo + i] = c - c_row
        t_chunk[t_lo + j] = c - c_row
        i1 = i + 1
        j1 = j + 1
        many_s = i1 - a0 > 1
        many_t = j1 - b0 > 1
        kind[c] = 2 * many_s + many_t  # CHUNK_1_1, CHUNK_1_N, CHUNK_N_1, CHUNK_N_M
        exact[c] = not (many_s or many_t)
        c_send[c] = i1
        c_tend[c] = j1
        c_bend[c] = ea
        close = ea == eb
        step_s = ea <= eb
        step_t = eb <= ea
        bad |= (step_s and not ok_s) or (step_t and not ok_t)
        c += close
        a0 = i1 if close else a0
        b0 = j1 if close else b0
        end_s = ea if step_s else end_s
        end_t = eb if step_t else end_t
        i += step_s
        j += step_t
    if bad or i < n or j < m:
        for k in range(s_lo, s_lo + n):
            s_chunk[k] = -1
        for k in range(t_lo, t_lo + m):
            t_chunk[k] = -1
        return -1
    return c


@njit(cache=True, nogil=True)
def _label_row(cand, n_cand, s_ids, s_lo, f_s, t_ids, t_lo, f_t, s_off, s_data, t_off, t_data,
               has_s, has_t, lossless, specials, s_chunk, t_chunk, kind, exact, c_send, c_tend,
               c_bend, c):  # fmt: skip
    """Turn one row's candidate chunks into labels; returns (next chunk index, dropped tokens).

    cand[q] = (student end, teacher end, byte end, from DP) of candidate q, consecutive from
    token 0 on both sides. A candidate holding a special token (other than zero-width ones at its
    ends, which stay -1; in a DP region every special counts as zero-width, as the DP sees no
    bytes for it) or left with no token on one side is dropped on both sides and its plain
    tokens counted. f_s / f_t: the row's token flags from _trust.

    Everything per chunk is written out here, on purpose: array arguments of a helper called
    per chunk (or tuples of arrays unpacked per chunk) cost reference counting on every call,
    which once made this loop 20x slower than the walk itself.
    """
    c_row = c
    dropped = 0
    a0 = 0
    b0 = 0
    for q in range(n_cand):
        a1 = cand[q, 0]
        b1 = cand[q, 1]
        dp = cand[q, 3] != 0
        i0 = a0
        i1 = a1
        j0 = b0
        j1 = b1
        s_sp = 0
        t_sp = 0
        if specials:  # rows without special tokens (the common case) skip these scans
            edge = _SPECIAL if dp else _SPECIAL | _ZERO  # specials trimmed off either end
            while i0 < i1 and f_s[i0] & edge == edge:
                i0 += 1
            while i1 > i0 and f_s[i1 - 1] & edge == edge:
                i1 -= 1
            for k in range(i0, i1):
                s_sp += (f_s[k] & _SPECIAL) != 0
            while j0 < j1 and f_t[j0] & edge == edge:
                j0 += 1
            while j1 > j0 and f_t[j1 - 1] & edge == edge:
                j1 -= 1
            for k in range(j0, j1):
                t_sp += (f_t[k] & _SPECIAL) != 0
        if s_sp or t_sp or i0 == i1 or j0 == j1:
            dropped += (i1 - i0 - s_sp) + (j1 - j0 - t_sp)
        else:
            local = c - c_row
            for k in range(s_lo + i0, s_lo + i1):
                s_chunk[k] = local
            for k in range(t_lo + j0, t_lo + j1):
                t_chunk[k] = local
            ns = i1 - i0
            nt = j1 - j0
            kind[c] = 0 if ns == 1 and nt == 1 else (1 if ns == 1 else (2 if nt == 1 else 3))
            same = ns == 1 and nt == 1
            # in a clean region of two lossless rows both tokens' bytes are the text's bytes
            if same and has_s and has_t and (dp or not lossless):
                same = _same_bytes(s_ids[s_lo + i0], t_ids[t_lo + j0], s_off, s_data, t_off, t_data)
            exact[c] = same
            c_send[c] = a1
            c_tend[c] = b1
            c_bend[c] = cand[q, 2]
            c += 1
        a0 = a1
        b0 = b1
    return c, dropped


# Per side: ids int32 [N], byte offsets int64 [N, 2], row splits int64 [B + 1], and (in `tabs`)
# the packed byte tables of `VocabBytes` (offsets, data, meta).
@njit(cache=True, nogil=True)
def align_kernel(s_ids, s_bo, s_splits, s_lossless, t_ids, t_bo, t_splits, t_lossless, tabs,
                  has_tab, force_dp):  # fmt: skip
    n_rows = s_splits.size - 1
    cap = 0
    max_n = 0
    max_m = 0
    for b in range(n_rows):
        n = s_splits[b + 1] - s_splits[b]
        m = t_splits[b + 1] - t_splits[b]
        cap += min(n, m)
        max_n = max(max_n, n)
        max_m = max(max_m, m)
    s_off, s_data, s_meta, t_off, t_data, t_meta = tabs
    has_s, has_t = has_tab
    s_chunk = np.empty(s_ids.size, np.int32)  # every row writes all of its tokens
    t_chunk = np.empty(t_ids.size, np.int32)
    kind = np.empty(cap, np.int8)
    exact = np.empty(cap, np.bool_)
    c_send = np.empty(cap, np.int32)
    c_tend = np.empty(cap, np.int32)
    c_bend = np.empty(cap, np.int64)
    dropped = np.zeros(n_rows, np.int32)
    chunk_splits = np.zeros(n_rows + 1, np.int64)
    fallback = np.zeros(n_rows, np.int32)
    err = np.zeros(n_rows, np.int8)
    tb_s = np.empty(max_n + 1, np.int64)
    tb_t = np.empty(max_m + 1, np.int64)
    f_s = np.empty(max_n + 1, np.uint8)
    f_t = np.empty(max_m + 1, np.uint8)
    reg = np.empty((min(max_n, max_m) + 1, 3), np.int64)
    cand = np.empty((min(max_n, max_m) + 1, 4), np.int64)
    loc_s = np.empty(max_n, np.int32)
    loc_t = np.empty(max_m, np.int32)
    c = 0
    for b in range(n_rows):
        s_lo = s_splits[b]
        t_lo = t_splits[b]
        n = s_splits[b + 1] - s_lo
        m = t_splits[b + 1] - t_lo
        if s_lossless[b] and t_lossless[b] and not force_dp:
            c_next = _walk_label_clean(s_ids, s_bo, s_lo, n, s_meta, has_s, t_ids, t_bo, t_lo, m,
                                       t_meta, has_t, s_chunk, t_chunk, kind, exact, c_send,
                                       c_tend, c_bend, c)  # fmt: skip
            if c_next >= 0:
                c = c_next
                chunk_splits[b + 1] = c
                continue
        s_chunk[s_lo : s_lo + n] = -1  # the general path labels only the chunks it keeps
        t_chunk[t_lo : t_lo + m] = -1
        bad_s, spec_s = _trust(s_ids, s_bo, s_lo, n, s_lossless[b], s_off, s_meta, has_s, tb_s, f_s)
        bad_t, spec_t = _trust(t_ids, t_bo, t_lo, m, t_lossless[b], t_off, t_meta, has_t, tb_t, f_t)
        n_reg = 0 if force_dp else _walk(tb_s, f_s, n, tb_t, f_t, m, reg)
        done_s = reg[n_reg - 1, 0] if n_reg else 0
        done_t = reg[n_reg - 1, 1] if n_reg else 0
        dirty_last = done_s < n or done_t < m
        if dirty_last:
            # the sides do not reach one common end: the rest is a DP region of its own, or joins
            # the last region when one side has nothing left
            if n_reg == 0 or (done_s < n and done_t < m):
                n_reg += 1
            reg[n_reg - 1, 0] = n
            reg[n_reg - 1, 1] = m
            reg[n_reg - 1, 2] = tb_s[n] if tb_s[n] == tb_t[m] else -1
        # regions -> candidate chunks: a clean region is one chunk, a dirty one goes to the DP
        n_cand = 0
        a0 = 0
        b0 = 0
        for r in range(n_reg):
            a1 = reg[r, 0]
            b1 = reg[r, 1]
            dirty = dirty_last and r == n_reg - 1
            if bad_s:
                for k in range(a0, a1):
                    dirty = dirty or (f_s[k] & _BAD) != 0
            if bad_t:
                for k in range(b0, b1):
                    dirty = dirty or (f_t[k] & _BAD) != 0
            if not dirty:
                cand[n_cand, 0] = a1
                cand[n_cand, 1] = b1
                cand[n_cand, 2] = reg[r, 2]
                cand[n_cand, 3] = 0
                n_cand += 1
            elif not (has_s and has_t):
                err[b] = ERR_NO_TABLE
                break
            else:
                fallback[b] += 1
                n_loc = dp_region_chunks(s_ids[s_lo + a0 : s_lo + a1], t_ids[t_lo + b0 : t_lo + b1],
                                         s_off, s_data, t_off, t_data, loc_s[: a1 - a0],
                                         loc_t[: b1 - b0])  # fmt: skip
                i = 0
                j = 0
                for q in range(n_loc):
                    while i < a1 - a0 and loc_s[i] == q:
                        i += 1
                    while j < b1 - b0 and loc_t[j] == q:
                        j += 1
                    cand[n_cand, 0] = a0 + i
                    cand[n_cand, 1] = b0 + j
                    cand[n_cand, 2] = reg[r, 2] if q == n_loc - 1 else -1
                    cand[n_cand, 3] = 1
                    n_cand += 1
                if n_loc == 0:  # one side empty: nothing to pair, counted as dropped below
                    cand[n_cand, 0] = a1
                    cand[n_cand, 1] = b1
                    cand[n_cand, 2] = -1
                    cand[n_cand, 3] = 1
                    n_cand += 1
            a0 = a1
            b0 = b1
        if err[b]:
            n_cand = 0  # a failed row keeps no chunk; row_error says why
        lossless = s_lossless[b] and t_lossless[b]
        c, dropped[b] = _label_row(cand, n_cand, s_ids, s_lo, f_s, t_ids, t_lo, f_t, s_off, s_data,
                                   t_off, t_data, has_s, has_t, lossless, spec_s + spec_t > 0,
                                   s_chunk, t_chunk, kind, exact, c_send, c_tend, c_bend,
                                   c)  # fmt: skip
        chunk_splits[b + 1] = c
    return (s_chunk, t_chunk, chunk_splits, kind[:c], exact[:c], c_send[:c], c_tend[:c],
            c_bend[:c], fallback, dropped, err)  # fmt: skip
