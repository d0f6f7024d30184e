"""DP fallback aligner: chunks two tokenizations from their tokens' canonical bytes alone.

For the regions whose offsets the fast path cannot trust: each side's token bytes are
concatenated and aligned by an edit-distance path, anchored on byte k-grams unique to both sides
and banded between anchors, so a long region never needs an O(A x B) table. On identical bytes
it gives exactly the fast path's chunks (docs/alignment.md, "Chunks").
"""

from __future__ import annotations

import numpy as np
from numba import njit

ANCHOR_K = 8  # k-gram length for anchors: long enough to be rare, short enough to find many
BAND = 32  # half-width of the DP band around each gap's diagonal
_INF = 1 << 30


@njit(cache=True, nogil=True)
def _kgram_hashes(x, k):
    """Polynomial rolling hash (mod 2**64) of every k-gram of the uint8 array x."""
    n = x.size - k + 1
    if n <= 0:
        return np.empty(0, np.uint64)
    mul = np.uint64(1099511628211)
    top = np.uint64(1)
    for _ in range(k - 1):
        top = top * mul
    h = np.empty(n, np.uint64)
    cur = np.uint64(0)
    for i in range(k):
        cur = cur * mul + np.uint64(x[i])
    h[0] = cur
    for i in range(1, n):
        cur = (cur - np.uint64(x[i - 1]) * top) * mul + np.uint64(x[i + k - 1])
        h[i] = cur
    return h


@njit(cache=True, nogil=True)
def _unique_sorted(h):
    """Hashes occurring exactly once in h, sorted, with their positions."""
    order = np.argsort(h, kind="mergesort")
    n = h.size
    keep = np.zeros(n, np.bool_)
    for i in range(n):
        v = h[order[i]]
        if (i == 0 or h[order[i - 1]] != v) and (i == n - 1 or h[order[i + 1]] != v):
            keep[i] = True
    pos = order[keep]
    return h[pos], pos


@njit(cache=True, nogil=True)
def _anchor_runs(a, b, k):
    """Diagonal runs (start_a, start_b, length) of k-grams unique to both a and b, monotone."""
    ha, pa_all = _unique_sorted(_kgram_hashes(a, k))
    hb, pb_all = _unique_sorted(_kgram_hashes(b, k))
    # merge the two sorted lists: pairs of positions holding the same unique k-gram
    pa = np.empty(min(ha.size, hb.size), np.int64)
    pb = np.empty_like(pa)
    npair = 0
    i = 0
    j = 0
    while i < ha.size and j < hb.size:
        if ha[i] < hb[j]:
            i += 1
        elif hb[j] < ha[i]:
            j += 1
        else:
            same = True  # hash collisions are possible: compare the bytes
            for q in range(k):
                if a[pa_all[i] + q] != b[pb_all[j] + q]:
                    same = False
                    break
            if same:
                pa[npair] = pa_all[i]
                pb[npair] = pb_all[j]
                npair += 1
            i += 1
            j += 1
    order = np.argsort(pa[:npair], kind="mergesort")
    pa = pa[:npair][order]
    pb = pb[:npair][order]
    # longest strictly increasing chain in pb (pa is already strictly increasing)
    tails = np.empty(npair, np.int64)
    prev = np.empty(npair, np.int64)
    length = 0
    for q in range(npair):
        lo = 0
        hi = length
        while lo < hi:
            mid = (lo + hi) // 2
            if pb[tails[mid]] < pb[q]:
                lo = mid + 1
            else:
                hi = mid
        prev[q] = tails[lo - 1] if lo > 0 else -1
        tails[lo] = q
        if lo == length:
            length += 1
    chain = np.empty(length, np.int64)
    q = tails[length - 1] if length > 0 else -1
    for r in range(length - 1, -1, -1):
        chain[r] = q
        q = prev[q]
    # fuse overlapping anchors on one diagonal into runs; drop anchors that cross a run
    runs = np.empty((length, 3), np.int64)
    nrun = 0
    end_a = -1
    end_b = -1
    for r in range(length):
        x = pa[chain[r]]
        y = pb[chain[r]]
        if nrun > 0 and x - y == runs[nrun - 1, 0] - runs[nrun - 1, 1] and x <= end_a:
            end_a = max(end_a, x + k)
            end_b = end_a - (x - y)
            runs[nrun - 1, 2] = end_a - runs[nrun - 1, 0]
        elif x >= end_a and y >= end_b:
            runs[nrun, 0] = x
            runs[nrun, 1] = y
            runs[nrun, 2] = k
            nrun += 1
            end_a = x + k
            end_b = y + k
    return runs[:nrun]


@njit(cache=True, nogil=True)
def _gap_path(a, b, x0, x1, y0, y1, px, py, n_nodes, band):
    """Append the banded edit path from (x0, y0) (already stored) to (x1, y1); returns n_nodes."""
    if x1 - x0 > y1 - y0:  # rows along the shorter side keep the table at O((nx + ny) * band)
        return _banded(b, a, y0, y1, x0, x1, py, px, n_nodes, band)
    return _banded(a, b, x0, x1, y0, y1, px, py, n_nodes, band)


@njit(cache=True, nogil=True)
def _banded(a, b, x0, x1, y0, y1, px, py, n_nodes, band):
    """Banded Needleman-Wunsch (unit costs) over a[x0:x1] x b[y0:y1], nx <= ny or one empty."""
    nx = x1 - x0
    ny = y1 - y0
    if nx == 0 or ny == 0:
        for s in range(1, nx + ny + 1):
            px[n_nodes] = x0 + (s if nx else 0)
            py[n_nodes] = y0 + (s if ny else 0)
            n_nodes += 1
        return n_nodes
    w = band + ny // nx + 1  # wide enough that consecutive rows' bands overlap
    width = 2 * w + 1
    moves = np.zeros((nx + 1, width), np.uint8)  # 0 diagonal, 1 from the row above, 2 from left
    prev = np.full(width, _INF, np.int64)
    cur = np.full(width, _INF, np.int64)
    plo = 0
    phi = min(ny, w)
    for j in range(plo, phi + 1):
        prev[j - plo] = j
        moves[0, j - plo] = 2
    for i in range(1, nx + 1):
        c = (i * ny) // nx
        lo = max(0, c - w)
        hi = min(ny, c + w)
        for j in range(lo, hi + 1):
            best = _INF
            move = 0
            if j >= 1 and plo <= j - 1 <= phi:
                best = prev[j - 1 - plo] + (1 if a[x0 + i - 1] != b[y0 + j - 1] else 0)
            if plo <= j <= phi and prev[j - plo] + 1 < best:
                best = prev[j - plo] + 1
                move = 1
            if j - 1 >= lo and cur[j - 1 - lo] + 1 < best:
                best = cur[j - 1 - lo] + 1
                move = 2
            cur[j - lo] = best
            moves[i, j - lo] = move
        prev, cur = cur, prev
        plo = lo
        phi = hi
    # trace back from (nx, ny), then append the nodes in forward order
    back_x = np.empty(nx + ny, np.int64)
    back_y = np.empty(nx + ny, np.int64)
    nb = 0
    i = nx
    j = ny
    while i > 0 or j > 0:
        back_x[nb] = i
        back_y[nb] = j
        nb += 1
        lo = max(0, (i * ny) // nx - w)
        move = moves[i, j - lo]
        if i == 0:
            move = 2
        if move == 0:
            i -= 1
            j -= 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    for r in range(nb - 1, -1, -1):
        px[n_nodes] = x0 + back_x[r]
        py[n_nodes] = y0 + back_y[r]
        n_nodes += 1
    return n_nodes


@njit(cache=True, nogil=True)
def byte_path(a, b):
    """Monotone edit path from (0, 0) to (len a, len b) through anchors and banded gaps."""
    px = np.empty(a.size + b.size + 1, np.int64)
    py = np.empty_like(px)
    px[0] = 0
    py[0] = 0
    n_nodes = 1
    x = 0
    y = 0
    runs = _anchor_runs(a, b, ANCHOR_K)
    for r in range(runs.shape[0]):
        sa = runs[r, 0]
        sb = runs[r, 1]
        n_nodes = _gap_path(a, b, x, sa, y, sb, px, py, n_nodes, BAND)
        for s in range(1, runs[r, 2] + 1):
            px[n_nodes] = sa + s
            py[n_nodes] = sb + s
            n_nodes += 1
        x = sa + runs[r, 2]
        y = sb + runs[r, 2]
    n_nodes = _gap_path(a, b, x, a.size, y, b.size, px, py, n_nodes, BAND)
    return px[:n_nodes], py[:n_nodes]


@njit(cache=True, nogil=True)
def _concat(ids, toff, tdata):
    """Canonical bytes of a token run and the token boundaries in them (offsets [n + 1])."""
    n = ids.size
    off = np.empty(n + 1, np.int64)
    off[0] = 0
    for k in range(n):
        t = ids[k]
        off[k + 1] = off[k] + toff[t + 1] - toff[t]
    out = np.empty(off[n], np.uint8)
    for k in range(n):
        t = ids[k]
        out[off[k] : off[k + 1]] = tdata[toff[t] : toff[t + 1]]
    return out, off


@njit(cache=True, nogil=True)
def path_chunks(px, py, oa, ob, out_a, out_b):
    """Chunk index per token of each side from an edit path; returns the number of chunks.

    oa / ob: token boundaries [n + 1] / [m + 1] in each side's byte string. Every token gets a
    chunk when both sides have tokens; a side left over at the end joins the last chunk.
    """
    n = oa.size - 1
    m = ob.size - 1
    out_a[:] = -1
    out_b[:] = -1
    if n == 0 or m == 0:
        return 0
    n_chunks = 0
    done_a = 0
    done_b = 0
    ka = 0
    kb = 0
    for q in range(px.size):
        x = px[q]
        y = py[q]
        while ka <= n and oa[ka] < x:
            ka += 1
        while kb <= m and ob[kb] < y:
            kb += 1
        if ka > n or kb > m or oa[ka] != x or ob[kb] != y:
            continue
        ha = ka
        while ha < n and oa[ha + 1] == x:
            ha += 1
        hb = kb
        while hb < m and ob[hb + 1] == y:
            hb += 1
        if ha > done_a and hb > done_b:
            out_a[done_a:ha] = n_chunks
            out_b[done_b:hb] = n_chunks
            n_chunks += 1
            done_a = ha
            done_b = hb
    if n_chunks == 0:
        out_a[:] = 0
        out_b[:] = 0
        return 1
    out_a[done_a:] = n_chunks - 1
    out_b[done_b:] = n_chunks - 1
    return n_chunks


@njit(cache=True, nogil=True)
def dp_region_chunks(a_ids, b_ids, a_toff, a_tdata, b_toff, b_tdata, out_a, out_b):
    """Chunk the token runs a_ids / b_ids by their canonical bytes; returns the chunk count."""
    a, oa = _concat(a_ids, a_toff, a_tdata)
    b, ob = _concat(b_ids, b_toff, b_tdata)
    px, py = byte_path(a, b)
    return path_chunks(px, py, oa, ob, out_a, out_b)


def pack_pieces(pieces: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n + 1], data uint8) of a list of byte strings, for the kernels."""
    lens = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    off = np.zeros(len(pieces) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8).copy()  # writable: one Numba type
    return off, data


def dp_chunks(
    student_pieces: list[bytes], teacher_pieces: list[bytes]
) -> tuple[np.ndarray, np.ndarray, int]:
    """Chunk two token sequences given only each token's bytes (no offsets, no ids).

    Returns (student_chunk int32 [n], teacher_chunk int32 [m], n_chunks). A convenience over the
    kernel for callers holding byte pieces; `tokenbridge.alignment.chunks` calls the kernel directly.
    """
    a_off, a_data = pack_pieces(student_pieces)
    b_off, b_data = pack_pieces(teacher_pieces)
    out_a = np.empty(len(student_pieces), np.int32)
    out_b = np.empty(len(teacher_pieces), np.int32)
    n = dp_region_chunks(
        np.arange(len(student_pieces), dtype=np.int32),  # int32 ids, as the aligner passes them
        np.arange(len(teacher_pieces), dtype=np.int32),
        a_off,
        a_data,
        b_off,
        b_data,
        out_a,
        out_b,
    )
    return out_a, out_b, int(n)


def edit_path(a: bytes, b: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The DP's path between two byte strings as node coordinates (x [L], y [L])."""
    return byte_path(np.frombuffer(a, np.uint8).copy(), np.frombuffer(b, np.uint8).copy())
