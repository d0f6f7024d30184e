"""Contents a template writes with their edge whitespace removed, located byte for byte.

Official templates often write ``message['content'] | trim`` (Llama 3.x, Gemma 2), and real chat
data is full of edge whitespace. `locate_trimmed` proves that the real rendering is the
scaffolding with each content minus some edge whitespace, comparing every character; a rendering
two choices explain is refused as ambiguous, never resolved by a rule (docs/alignment.md,
"Conversations").
"""

from __future__ import annotations

import numpy as np

REWRITES = ("none", "lstrip", "rstrip", "trim")  # per content: which edges lost whitespace
_NO_MATCH = "not the template's text around the contents, verbatim or less edge whitespace"


def _common(a: str, i: int, b: str, j: int, limit: int) -> int:
    """Length of the common prefix of a[i:] and b[j:], at most `limit` (whitespace runs)."""
    n = 0
    while n < limit and i + n < len(a) and j + n < len(b) and a[i + n] == b[j + n]:
        n += 1
    return n


def _candidates(real: str, p: int, c: str) -> list[tuple[int, int, int]]:
    """(end, l, r) for every way content `c`, less l leading and r trailing whitespace
    characters, is the text of `real` from position p to end (one way per end)."""
    n = len(c)
    lead = n - len(c.lstrip())
    if lead == n:  # all whitespace (or empty): written whole, or left out whole
        whole = [(p + n, 0, 0)] if n and real.startswith(c, p) else []
        return [*whole, (p, n, 0)]
    trail = n - len(c.rstrip())
    # the content's first non-space character is the first one at or after p: that fixes l
    k = 0
    while k <= lead and p + k < len(real) and real[p + k].isspace():
        k += 1
    if k > lead or not real.startswith(c[lead - k : n - trail], p):
        return []
    end = p + k + (n - trail - lead)
    kept = _common(c, n - trail, real, end, trail)
    return [(end + t, lead - k, trail - t) for t in range(kept + 1)]


def locate_trimmed(
    real: str, scaffolding: list[str], contents: list[str]
) -> tuple[np.ndarray, np.ndarray] | str:
    """Char spans [n, 2] of each content in `real` and the whitespace characters left out of
    it [n, 2] (leading, trailing); or why `real` is not scaffolding + trimmed contents.

    scaffolding: the n + 1 texts before, between and after the n contents.
    """
    n = len(contents)
    if len(scaffolding) != n + 1:
        raise ValueError(f"{len(scaffolding)} scaffolding texts for {n} contents")
    # layer i: start of scaffolding i in `real` -> (ways to get there, capped at 2; the step)
    layers: list[dict[int, tuple[int, tuple | None]]] = [{0: (1, None)}]
    for i, c in enumerate(contents):
        nxt: dict[int, tuple[int, tuple | None]] = {}
        for p, (ways, _) in layers[-1].items():
            if not real.startswith(scaffolding[i], p):
                continue
            q = p + len(scaffolding[i])
            for end, lead, trail in _candidates(real, q, c):
                w, step = nxt.get(end, (0, None))
                nxt[end] = (min(w + ways, 2), step or (p, q, lead, trail))
        if not nxt:
            return f"{_NO_MATCH} (none from message {i} on)"
        layers.append(nxt)
    tail = scaffolding[n]
    done = [(p, w) for p, (w, _) in layers[-1].items()
            if p + len(tail) == len(real) and real.startswith(tail, p)]  # fmt: skip
    ways = sum(w for _, w in done)
    if ways == 0:
        return f"{_NO_MATCH} (none after the last content)"
    if ways > 1:
        return "ambiguous: the whitespace between two contents could belong to either"
    spans = np.zeros((n, 2), np.int64)
    removed = np.zeros((n, 2), np.int64)
    p = done[0][0]
    for i in range(n, 0, -1):
        prev, q, lead, trail = layers[i][p][1]
        spans[i - 1] = (q, p)
        removed[i - 1] = (lead, trail)
        p = prev
    return spans, removed


def removed_bytes(contents: list[str], removed: np.ndarray) -> np.ndarray:
    """int64 [n, 2]: UTF-8 bytes of the leading / trailing whitespace left out of each content
    (`locate_trimmed`'s characters; non-ASCII spaces such as U+3000 are several bytes)."""
    out = np.zeros_like(removed)
    for i, (c, (lead, trail)) in enumerate(zip(contents, removed.tolist())):
        out[i] = (len(c[:lead].encode("utf-8")), len(c[len(c) - trail :].encode("utf-8")))
    return out


def rewrite_kinds(cut: np.ndarray) -> np.ndarray:
    """int64 [n]: index into `REWRITES` of each content's (leading, trailing) cut."""
    return (cut[:, 0] > 0).astype(np.int64) + 2 * (cut[:, 1] > 0)
