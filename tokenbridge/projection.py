"""Sparse vocabulary projections between a teacher and a student tokenizer: builder and file.

For every token of one vocabulary, the tokens of the other it stands for (a sparse top-k row, by
re-tokenizing its bytes, the first token weighted most), in both directions, plus the exact map
of byte-identical tokens; nothing of shape V_s x V_t is built (method: docs/alignment.md, "The
projection"). ``make projection`` (`pipelines.projection`) builds one from two model
directories; a loop of your own calls `build_projection` / `load_projection`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tokenbridge import atomic
from tokenbridge.formats.shard_schema import TokenizerInfo
from tokenbridge.tokenizers import Tokenizer, TokenizerError

FORMAT_VERSION = "1"
METHOD = "retokenize-geometric-v1"
ROLES = ("bos", "eos", "pad", "unk")
TENSORS = ("t2s_ids", "t2s_weights", "s2t_ids", "s2t_weights", "exact_t2s", "exact_s2t")


class ProjectionMismatchError(ValueError):
    """The projection was built for other tokenizers (fingerprints differ) or is malformed."""


class ProjectionCoverageError(ValueError):
    """The exact map covers implausibly few tokens: a broken build or the wrong pair."""


@dataclass(frozen=True)
class Projection:
    t2s_ids: np.ndarray  # int32 [V_t_rows, k], -1 = empty slot
    t2s_weights: np.ndarray  # float32 [V_t_rows, k], rows sum to 1 (or 0 when empty)
    s2t_ids: np.ndarray  # int32 [V_s_rows, k]
    s2t_weights: np.ndarray  # float32 [V_s_rows, k]
    exact_t2s: np.ndarray  # int32 [V_t_rows]: student id with identical bytes, or -1
    exact_s2t: np.ndarray  # int32 [V_s_rows]
    meta: dict = field(default_factory=dict)  # str -> str

    def exact_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(teacher ids, student ids) of the one-to-one exact pairs: t -> s and s -> t agree."""
        t = np.flatnonzero(self.exact_t2s >= 0)
        s = self.exact_t2s[t]
        mutual = self.exact_s2t[s] == t
        return t[mutual].astype(np.int64), s[mutual].astype(np.int64)


def model_rows(path: str | os.PathLike) -> int | None:
    """The lm_head width of a model directory (config.json ``vocab_size``), else None."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return None
    c = json.loads(cfg.read_text())
    v = c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")
    return int(v) if v else None


def exact_index(tok: Tokenizer, token_bytes: list[bytes | None]) -> dict[bytes, int]:
    """bytes -> the id that stands for them; among tokens sharing bytes, the one the tokenizer
    emits itself when encoding them (else the lowest id)."""
    index: dict[bytes, int] = {}
    dups: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes):
        if not b or i in tok.all_special_ids:
            continue
        if b in index:
            dups.setdefault(b, [index[b]]).append(i)
        else:
            index[b] = i
    texts = []
    for b in dups:
        try:
            texts.append((b, b.decode("utf-8")))
        except UnicodeDecodeError:
            continue
    if texts:
        enc = tok.encode_batch([t for _, t in texts])
        for r, (b, _) in enumerate(texts):
            ids = enc.ids[enc.row_splits[r] : enc.row_splits[r + 1]]
            if len(ids) == 1 and int(ids[0]) in dups[b]:
                index[b] = int(ids[0])
    return index


def _pieces(src_bytes, need: np.ndarray, dst_single: dict[int, int]):
    """Source rows to re-tokenize -> texts to encode, the rows whose bytes are one UTF-8 text
    (texts[j] is row simple[j]), and the other rows as segment lists: ("t", index into texts)
    or ("b", target id of one raw byte, None if the target has no such token)."""
    texts: list[str] = []
    simple: list[int] = []
    split: list[tuple[int, list]] = []
    for i in need.tolist():
        try:
            texts.append(src_bytes[i].decode("utf-8"))
            simple.append(i)
        except UnicodeDecodeError:
            split.append((i, []))
    for i, segs in split:
        run = ""
        for ch in src_bytes[i].decode("utf-8", errors="surrogateescape"):
            if "\udc80" <= ch <= "\udcff":  # an undecodable byte, escaped
                if run:
                    texts.append(run)
                    segs.append(("t", len(texts) - 1))
                    run = ""
                segs.append(("b", dst_single.get(ord(ch) - 0xDC00)))
            else:
                run += ch
        if run:
            texts.append(run)
            segs.append(("t", len(texts) - 1))
    return texts, np.array(simple, np.int64), split


def _encode_ids(tok: Tokenizer, texts: list[str], *, chunk: int = 8192):
    """(ids, row_splits) of all texts; a text the tokenizer refuses (found by bisecting the
    failing chunk) gets no ids and is counted, so one odd token cannot stop a build."""
    ids, lengths, failed = [], [], 0

    def go(part: list[str]):
        nonlocal failed
        try:
            enc = tok.encode_batch(part)
        except TokenizerError:
            if len(part) == 1:
                failed += 1
                lengths.append(0)
                return
            go(part[: len(part) // 2])
            go(part[len(part) // 2 :])
            return
        ids.append(enc.ids)
        lengths.extend(np.diff(enc.row_splits).tolist())

    starts = range(0, len(texts), chunk)
    for start in tqdm(starts, desc=f"re-tokenize with {tok.name}", unit="chunk", disable=None):
        go(texts[start : start + chunk])
    splits = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lengths, out=splits[1:])
    return (np.concatenate(ids) if ids else np.zeros(0, np.int32)), splits, failed


def _retokenized(dst: Tokenizer, src_bytes, need, dst_single):
    """Flat (row, target id) pairs in sequence order, and how many rows hit an unmappable byte."""
    texts, simple, split = _pieces(src_bytes, need, dst_single)
    if not texts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), {"encode_errors": 0}
    enc_ids, splits, failed = _encode_ids(dst, texts)
    m = len(simple)
    rows = [np.repeat(simple, np.diff(splits[: m + 1]))]
    ids = [enc_ids[: splits[m]].astype(np.int64)]
    unmappable = 0
    for i, segs in split:
        seq = []
        for kind, v in segs:
            if kind == "t":
                seq.append(enc_ids[splits[v] : splits[v + 1]].astype(np.int64))
            elif v is None:
                seq = None
                break
            else:
                seq.append(np.array([v], np.int64))
        if seq is None:
            unmappable += 1
        elif seq:
            flat = np.concatenate(seq)
            rows.append(np.full(len(flat), i, np.int64))
            ids.append(flat)
    counts = {"invalid_utf8_rows": len(split), "unmappable_byte_rows": unmappable}
    return np.concatenate(rows), np.concatenate(ids), counts | {"encode_errors": failed}


def _direction(src: Tokenizer, dst: Tokenizer, *, k: int, src_rows: int, dst_rows: int):
    """One direction src -> dst: (ids [src_rows, k], weights, exact [src_rows], counts)."""
    src_bytes, dst_bytes = src.token_bytes(), dst.token_bytes()
    n_src = len(src_bytes)
    # exact map first: a source token whose bytes are a target token's is one-hot on it
    index = exact_index(dst, dst_bytes)
    exact = np.full(src_rows, -1, np.int32)
    for i, b in enumerate(src_bytes):
        if b and i not in src.all_special_ids:
            exact[i] = index.get(b, -1)
    dst_single = {b[0]: j for b, j in index.items() if len(b) == 1}

    has_bytes = np.array([bool(b) for b in src_bytes], bool)
    special = np.zeros(n_src, bool)
    special[[i for i in src.all_special_ids if i < n_src]] = True
    need = np.flatnonzero(has_bytes & ~special & (exact[:n_src] < 0))
    # The rest is numpy over flat arrays, one entry per (source row, re-tokenized target id), so
    # that no [V_src, V_dst] table and no per-row Python loop is ever needed. Each row's entries
    # form one contiguous run of `row`, in the order the target tokenizer emitted them.
    row, tid, retok_counts = _retokenized(dst, src_bytes, need, dst_single)
    keep = ~np.isin(tid, np.fromiter(dst.all_special_ids, np.int64)) & (tid < dst_rows)
    dropped_special = int((~keep).sum())
    row, tid = row[keep], tid[keep]
    # position j of each entry within its run: its index minus the index where its run starts
    # (run starts are where `row` changes; each start repeated over its run's length)
    start = np.r_[0, np.flatnonzero(np.diff(row)) + 1]
    pos = np.arange(len(row)) - np.repeat(start, np.diff(np.r_[start, len(row)]))
    w = np.power(0.5, pos)  # the j-th re-tokenized token weighs 2^-j
    # repeated ids within a row add up: unique (row, id), weight summed, first position kept
    key = row * dst_rows + tid
    uk, first, inv = np.unique(key, return_index=True, return_inverse=True)
    uw = np.bincount(inv, weights=w)
    urow, uid, upos = uk // dst_rows, uk % dst_rows, pos[first]
    # heaviest first (ties: earlier position), then rank within row; lexsort's LAST key is the
    # primary one, so this sorts by row, then by weight descending, then by position
    order = np.lexsort((upos, -uw, urow))
    urow, uid, uw = urow[order], uid[order], uw[order]
    rstart = np.r_[0, np.flatnonzero(np.diff(urow)) + 1]
    rank = np.arange(len(urow)) - np.repeat(rstart, np.diff(np.r_[rstart, len(urow)]))
    truncated = int(np.unique(urow[rank >= k]).size)  # rows with more than k distinct ids
    top = rank < k
    urow, uid, uw, rank = urow[top], uid[top], uw[top], rank[top]
    total = np.bincount(urow, weights=uw, minlength=src_rows)  # the kept mass of each row

    # scatter into the [rows, k] top-k tables (slot = rank) and renormalise each row to sum 1
    ids_out = np.full((src_rows, k), -1, np.int32)
    w_out = np.zeros((src_rows, k), np.float32)
    ids_out[urow, rank] = uid
    w_out[urow, rank] = uw / total[urow]
    # exact rows were never re-tokenized (not in `need`): their whole row is slot 0
    hit = np.flatnonzero(exact >= 0)
    ids_out[hit, 0], w_out[hit, 0] = exact[hit], 1.0
    role_pairs, paired = 0, set()
    for role in ROLES:  # in this order: an id with two roles (eos = pad) keeps the first
        a, b = src.special_ids.get(role), dst.special_ids.get(role)
        if a is not None and b is not None and a < src_rows and b < dst_rows and a not in paired:
            paired.add(a)
            ids_out[a], w_out[a] = -1, 0.0
            ids_out[a, 0], w_out[a, 0] = b, 1.0
            role_pairs += 1
    n_with_bytes = int((has_bytes & ~special).sum())
    counts = {
        "tokens": n_src,
        "tokens_with_bytes": n_with_bytes,
        "exact": int((exact >= 0).sum()),
        "retokenized": int(len(need)),
        "invalid_utf8_rows": 0,
        "unmappable_byte_rows": 0,
        **retok_counts,
        "dropped_special_ids": dropped_special,
        "truncated_rows": truncated,
        "role_pairs": role_pairs,
        "empty_rows": int((ids_out[:n_src, 0] < 0).sum()),
        "padded_rows": src_rows - n_src,
    }
    return ids_out, w_out, exact, counts


def _rows(tok: Tokenizer, rows: int | None, role: str) -> int:
    rows = tok.vocab_size if rows is None else int(rows)
    if rows < tok.vocab_size:
        raise ValueError(
            f"{role} {tok.name}: {rows} lm_head rows but the tokenizer emits ids up to "
            f"{tok.vocab_size - 1}"
        )
    return rows


def build_projection(
    teacher: Tokenizer,
    student: Tokenizer,
    *,
    k: int = 8,
    teacher_rows: int | None = None,
    student_rows: int | None = None,
) -> Projection:
    """Both directions and the exact maps (the method: docs/alignment.md, "The projection")."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t_rows, s_rows = (
        _rows(teacher, teacher_rows, "teacher"),
        _rows(student, student_rows, "student"),
    )
    t2s, t2s_w, ex_t2s, ct = _direction(teacher, student, k=k, src_rows=t_rows, dst_rows=s_rows)
    s2t, s2t_w, ex_s2t, cs = _direction(student, teacher, k=k, src_rows=s_rows, dst_rows=t_rows)
    meta = {
        "format_version": FORMAT_VERSION,
        "method": METHOD,
        "weighting": "j-th token of a re-tokenization gets 2^-j, top-k, renormalised",
        "k": str(k),
        "exact_coverage": str(_coverage(ex_t2s, ex_s2t, ct, cs)),
    }
    for role, tok, rows in (("teacher", teacher, t_rows), ("student", student, s_rows)):
        meta |= {
            f"{role}_name": tok.name,
            f"{role}_fingerprint": tok.fingerprint,
            f"{role}_vocab_size": str(tok.vocab_size),
            f"{role}_rows": str(rows),
        }
    meta |= {f"t2s_{key}": str(v) for key, v in ct.items()}
    meta |= {f"s2t_{key}": str(v) for key, v in cs.items()}
    return Projection(t2s, t2s_w, s2t, s2t_w, ex_t2s, ex_s2t, meta)


def _coverage(ex_t2s, ex_s2t, ct, cs) -> float:
    """Exact pairs over the smaller vocabulary's tokens that have bytes."""
    denom = min(ct["tokens_with_bytes"], cs["tokens_with_bytes"])
    pairs = min(int((ex_t2s >= 0).sum()), int((ex_s2t >= 0).sum()))
    return pairs / denom if denom else 0.0


def save_projection(p: Projection, path: str | os.PathLike) -> Path:
    """Write `.safetensors` (tensors + str metadata) atomically: temporary file, then rename."""
    from safetensors.numpy import save_file

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(getattr(p, name)) for name in TENSORS}
    with atomic.replacing(final) as tmp:
        save_file(tensors, str(tmp), metadata={k: str(v) for k, v in p.meta.items()})
    return final


def _check_side(meta: dict, role: str, want: TokenizerInfo | None, where: str) -> None:
    if want is None:
        return
    found = meta.get(f"{role}_fingerprint")
    if found != want.fingerprint:
        raise ProjectionMismatchError(
            f"{where}: built for {role} {meta.get(f'{role}_name')} "
            f"(fingerprint {str(found)[:16]}..., vocab {meta.get(f'{role}_vocab_size')}), "
            f"but the {role} is {want.name} (fingerprint {want.fingerprint[:16]}..., "
            f"vocab {want.vocab_size}); rebuild with `make projection`"
        )


def load_projection(
    path: str | os.PathLike,
    *,
    teacher: TokenizerInfo | None = None,
    student: TokenizerInfo | None = None,
    min_exact_coverage: float = 0.05,
) -> Projection:
    """Read a projection, refusing other tokenizers, a malformed file, or an exact map that
    covers fewer than `min_exact_coverage` of the smaller vocabulary."""
    from safetensors import SafetensorError, safe_open

    where = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}: no projection file (build it with `make projection`)")
    try:
        with safe_open(where, framework="np") as f:
            meta = dict(f.metadata() or {})
            missing = [n for n in TENSORS if n not in f.keys()]  # noqa: SIM118 - safe_open API
            if missing or meta.get("format_version") != FORMAT_VERSION:
                raise ProjectionMismatchError(
                    f"{where}: not a tokenbridge projection v{FORMAT_VERSION} "
                    f"(format_version={meta.get('format_version')}, missing tensors {missing})"
                )
            arrays = {n: f.get_tensor(n) for n in TENSORS}
    except SafetensorError as e:  # a damaged file: refused by name, as every reader does
        raise ProjectionMismatchError(
            f"{where}: damaged, not a readable safetensors file ({e}); rebuild it with "
            "`make projection`"
        ) from None
    _check_side(meta, "teacher", teacher, where)
    _check_side(meta, "student", student, where)
    t_rows, s_rows, k = int(meta["teacher_rows"]), int(meta["student_rows"]), int(meta["k"])
    shapes = {
        "t2s_ids": (t_rows, k),
        "t2s_weights": (t_rows, k),
        "s2t_ids": (s_rows, k),
        "s2t_weights": (s_rows, k),
        "exact_t2s": (t_rows,),
        "exact_s2t": (s_rows,),
    }
    for name, shape in shapes.items():
        if arrays[name].shape != shape:
            raise ProjectionMismatchError(
                f"{where}: {name} has shape {arrays[name].shape}, metadata says {shape}"
            )
    p = Projection(**arrays, meta=meta)
    t_bytes, s_bytes = int(meta["t2s_tokens_with_bytes"]), int(meta["s2t_tokens_with_bytes"])
    pairs = len(p.exact_pairs()[0])
    coverage = pairs / max(1, min(t_bytes, s_bytes))
    if coverage < min_exact_coverage:
        raise ProjectionCoverageError(
            f"{where}: the exact map pairs only {pairs} tokens, {coverage:.1%} of the smaller "
            f"vocabulary (expected >= {min_exact_coverage:.0%}): the tokens' bytes were not "
            "compared correctly, or these tokenizers share almost nothing"
        )
    return p


def describe(p: Projection) -> str:
    m = p.meta
    return (
        f"{m['teacher_name']} ({m['teacher_rows']} rows) x {m['student_name']} "
        f"({m['student_rows']} rows), k={m['k']}: exact pairs {len(p.exact_pairs()[0])} "
        f"(coverage {float(m['exact_coverage']):.1%}); "
        f"t2s exact {m['t2s_exact']} retokenized {m['t2s_retokenized']} "
        f"empty {m['t2s_empty_rows']} (padded {m['t2s_padded_rows']}); "
        f"s2t exact {m['s2t_exact']} retokenized {m['s2t_retokenized']} "
        f"empty {m['s2t_empty_rows']} (padded {m['s2t_padded_rows']})"
    )
