"""On-the-fly alignment of a rollout to a teacher with another tokenizer.

The student's sampled ids are the truth, never re-tokenized: their bytes are decoded leniently
(a sampled byte sequence need not be UTF-8), rendered in the teacher's form and aligned with the
align job's own function, so a raw-text rollout gets the chunks the job writes for the same
text. Only completion chunks get a term; a rollout the teacher cannot take gets a drop reason
and is counted, never a crash (docs/onpolicy.md, "A step", 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.alignment import AlignmentError, align
from tokenbridge.chat.align import ChatSide
from tokenbridge.chat.encode import encode_renderings
from tokenbridge.chat.render import Rendering
from tokenbridge.tokenizers import Encoding, Tokenizer, TokenizerError
from trainer.onpolicy.prompts import render_prompt

REPLACEMENT = "\ufffd"

# drop reasons (metric names: onpolicy/dropped_<reason>)
DROP_TEACHER_ERROR = "teacher_error"  # the teacher's tokenizer or the aligner refused the text
DROP_TOO_LONG = "too_long"  # longer than the teacher's slot
DROP_NO_CHUNK = "no_completion_chunk"  # nothing of the completion left to compare
DROP_REASONS = (DROP_TEACHER_ERROR, DROP_TOO_LONG, DROP_NO_CHUNK)


@dataclass(frozen=True)
class LenientText:
    """A byte string as text: invalid pieces replaced, positions mapped."""

    text: str
    pos_map: np.ndarray  # int64 [n + 1]: byte position in the input -> byte position in text
    bad: np.ndarray  # bool [n]: the byte belongs to an invalid piece
    valid: bool


def lenient_text(data: bytes) -> LenientText:
    """Decode UTF-8, each invalid piece (as Python's decoder delimits it) -> one U+FFFD."""
    n = len(data)
    pos_map = np.zeros(n + 1, np.int64)
    bad = np.zeros(n, bool)
    parts: list[str] = []
    at, out = 0, 0
    while at < n:
        try:
            piece = data[at:].decode("utf-8")
            end = n
        except UnicodeDecodeError as e:
            piece, end = data[at : at + e.start].decode("utf-8"), at + e.start
            lo, hi = end, at + e.end
        pos_map[at : end + 1] = out + np.arange(end - at + 1)
        parts.append(piece)
        out += end - at
        if end == n:
            break
        pos_map[lo:hi] = out  # inside the invalid piece: where its replacement starts
        bad[lo:hi] = True
        parts.append(REPLACEMENT)
        out += len(REPLACEMENT.encode())
        pos_map[hi] = out
        at = hi
    return LenientText("".join(parts), pos_map, bad, not bad.any())


@dataclass(frozen=True)
class TeacherView:
    """What on-the-fly alignment needs of one teacher."""

    tokenizer: Tokenizer
    max_len: int  # longest teacher row its slot holds
    chat: ChatSide | None = None  # chat prompts: the teacher's template side
    stop_id: int | None = None  # paired with the student's stop token (EOS / end-of-turn)


@dataclass(frozen=True)
class RolloutAlignment:
    """One rollout x one teacher. Chunk ids count completion chunks only, from 0."""

    teacher_ids: np.ndarray  # int64 [U]
    student_chunk: np.ndarray  # int64 [S] over prompt + completion, -1 outside kept chunks
    teacher_chunk: np.ndarray  # int64 [U]
    n_chunks: int
    dropped: str | None = None
    boundary_chunks: int = 0  # chunks dropped for straddling the prompt / completion edge
    invalid_chunks: int = 0  # chunks dropped for covering bytes that are not UTF-8


def _dropped(reason: str) -> RolloutAlignment:
    empty = np.zeros(0, np.int64)
    return RolloutAlignment(empty, empty, empty, 0, reason)


def _student_body(ids: list[int], tok: Tokenizer) -> tuple[np.ndarray, bytes, np.ndarray]:
    """(positions of tokens with bytes, their joined bytes, their byte offsets [n, 2])."""
    table = tok.token_bytes()
    pos = [i for i, t in enumerate(ids) if 0 <= t < len(table) and table[t] is not None]
    pieces = [table[ids[i]] for i in pos]
    lens = np.fromiter((len(p) for p in pieces), np.int64, len(pieces))
    ends = np.cumsum(lens)
    offs = np.stack([ends - lens, ends], axis=1) if len(pieces) else np.zeros((0, 2), np.int64)
    return np.asarray(pos, np.int64), b"".join(pieces), offs


def _student_encoding(ids: np.ndarray, offs: np.ndarray, lt: LenientText) -> Encoding:
    mapped = lt.pos_map[offs] if len(offs) else offs
    # char offsets are not read by the aligner; the byte offsets are the contract
    return Encoding(ids.astype(np.int32), mapped.copy(), mapped, lt.valid)


def _invalid_tokens(offs: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """bool [n]: the token covers a byte of an invalid piece."""
    cum = np.concatenate([[0], np.cumsum(bad)])
    return (cum[offs[:, 1]] - cum[offs[:, 0]]) > 0 if len(offs) else np.zeros(0, bool)


def _keep_completion_chunks(s_chunk, t_chunk, n_chunks, *, first_completion, invalid):
    """Renumber the chunks whose student tokens are all completion tokens and valid bytes;
    returns (student chunk, teacher chunk, kept, boundary drops, invalid drops)."""
    if n_chunks == 0:
        return s_chunk, t_chunk, 0, 0, 0
    live = s_chunk >= 0
    idx = np.arange(s_chunk.size)
    first = np.full(n_chunks, s_chunk.size, np.int64)
    np.minimum.at(first, s_chunk[live], idx[live])
    has_bad = np.zeros(n_chunks, bool)
    has_bad[s_chunk[live & invalid]] = True
    present = np.zeros(n_chunks, bool)
    present[s_chunk[live]] = True
    completion = present & (first >= first_completion)
    keep = completion & ~has_bad
    new = np.where(keep, np.cumsum(keep) - 1, -1)

    def renumber(c):
        return np.where(c >= 0, new[np.maximum(c, 0)], -1)

    # a chunk that holds both the last prompt token and the first completion token
    boundary = int(_straddles(s_chunk, first_completion))
    dropped_invalid = int((completion & has_bad).sum())
    return renumber(s_chunk), renumber(t_chunk), int(keep.sum()), boundary, dropped_invalid


def _straddles(s_chunk: np.ndarray, first_completion: int) -> bool:
    if first_completion == 0 or first_completion >= s_chunk.size:
        return False
    a, b = s_chunk[first_completion - 1], s_chunk[first_completion]
    return bool(a >= 0 and a == b)


def _assemble(prefix_t, t_body, t_chunk_body, s_chunk_full, n, *, stopped, view, s_last):
    """Teacher ids/chunks with the prefix and the paired stop; returns the alignment."""
    t_ids = np.concatenate([np.asarray(prefix_t, np.int64), np.asarray(t_body, np.int64)])
    t_chunk = np.concatenate([np.full(len(prefix_t), -1, np.int64), t_chunk_body])
    if stopped and view.stop_id is not None and s_last is not None:
        t_ids = np.append(t_ids, view.stop_id)
        t_chunk = np.append(t_chunk, n)
        s_chunk_full = s_chunk_full.copy()
        s_chunk_full[s_last] = n
        n += 1
    return t_ids, t_chunk, s_chunk_full, n


def align_rollout(
    prompt: list[int],
    completion: list[int],
    *,
    stopped: bool,
    student: Tokenizer,
    view: TeacherView,
    messages: tuple[dict, ...] | None = None,
) -> RolloutAlignment:
    """Chunks of one rollout for one teacher: its completion chunks only (a chunk straddling
    the prompt and the completion, or covering an invalid byte, is dropped and counted), plus
    the student's stop id paired with the teacher's (EOS for raw text, end-of-turn for chat) by
    role, never by text; or a drop reason (docs/onpolicy.md, "A step", 3)."""
    ids = list(prompt) + list(completion)
    first_completion_tok = len(prompt)
    pos, data, offs = _student_body(ids, student)
    if messages is not None and view.chat is not None:
        # chat: only the completion's bytes are aligned, after the teacher's own rendering
        # (the templates' scaffolding is never aligned by text)
        in_comp = pos >= first_completion_tok
        pos, offs = pos[in_comp], offs[in_comp]
        base = int(offs[0, 0]) if len(offs) else len(data)
        data, offs = data[base:], offs - base
    lt = lenient_text(data)
    s_enc = _student_encoding(np.asarray(ids, np.int64)[pos], offs, lt)
    invalid = _invalid_tokens(offs, lt.bad)
    s_last = len(ids) - 1 if stopped and completion else None  # the stop id ends the rollout
    try:
        if messages is not None and view.chat is not None:
            prefix_t, t_enc = _chat_teacher(view, messages, lt.text)
            if prefix_t is None:
                return _dropped(DROP_TEACHER_ERROR)
            first_body = 0
        else:
            # raw text is aligned whole, as the align job aligns a text: a rollout's chunks are
            # the chunks the job writes for the same text
            t_enc = view.tokenizer.encode(lt.text)
            bos = view.tokenizer.bos_id
            prefix_t = [bos] if bos is not None else []
            first_body = int((pos < first_completion_tok).sum())
        al = align(s_enc, t_enc, student_bytes=student, teacher_bytes=view.tokenizer)
    except (TokenizerError, AlignmentError, ValueError):
        return _dropped(DROP_TEACHER_ERROR)
    s_body_chunk, t_body_chunk, n, boundary, n_invalid = _keep_completion_chunks(
        al.student_chunk.astype(np.int64),
        al.teacher_chunk.astype(np.int64),
        al.n_chunks,
        first_completion=first_body,
        invalid=invalid,
    )
    s_chunk = np.full(len(ids), -1, np.int64)
    s_chunk[pos] = s_body_chunk
    if s_last is not None and s_chunk[s_last] >= 0:
        s_last = None  # the stop id had bytes (a plain token): it is in a text chunk already
    t_ids, t_chunk, s_chunk, n = _assemble(
        prefix_t, t_enc.ids, t_body_chunk, s_chunk, n, stopped=stopped, view=view, s_last=s_last
    )
    if len(t_ids) > view.max_len:
        return _dropped(DROP_TOO_LONG)
    if n == 0:
        return _dropped(DROP_NO_CHUNK)
    return RolloutAlignment(t_ids, s_chunk, t_chunk, n, None, boundary, n_invalid)


def _chat_teacher(view: TeacherView, messages, completion_text: str):
    """(teacher prefix ids, Encoding of the completion's teacher tokens) or (None, None) when
    the teacher's template refuses the conversation or no token boundary falls where the
    completion starts."""
    side = view.chat
    r = render_prompt(side, list(messages))
    if r is None:
        return None, None
    start = len(r.text)
    spans = np.concatenate([r.spans, [[start, start + len(completion_text)]]])
    full = Rendering(r.text + completion_text, spans.astype(np.int64))
    enc = encode_renderings(view.tokenizer, side.matcher, [full])
    base = len(r.text.encode("utf-8"))
    starts = enc.byte_offsets[:, 0]
    ends = enc.byte_offsets[:, 1]
    cut = int(np.searchsorted(starts, base, side="left"))
    if cut > 0 and ends[cut - 1] > base:  # a teacher token straddles the completion's start
        return None, None
    body = slice(cut, len(enc.ids))
    t_offs = enc.byte_offsets[body] - base
    t_enc = Encoding(enc.ids[body], t_offs, t_offs, bool(enc.lossless[body].all()))
    return enc.ids[:cut].astype(np.int64), t_enc
