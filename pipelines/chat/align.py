"""Conversations -> per-token arrays per side: ids, chunks, train flags, message and role ids.

For a batch of conversations and one student + K teachers (`ChatSide`, prepared once):

1. each side renders each conversation with its own template and locates the contents
   (`pipelines.chat.render`); a refusal by any side dead-letters the conversation;
2. each side tokenizes its renderings (`pipelines.chat.encode`) and finds every message's
   content tokens and turn markers (`pipelines.chat.markers`);
3. per (student, teacher) pair, the content of every message is aligned by the ordinary offset
   aligner, all messages of the batch in one kernel call; turn markers are paired by message;
4. the student's train flags are set (`train_flags`).

Chunks, per pair: ids from 0, non-decreasing along both sides, each id present on both sides.
`chunk_kind` says what a chunk is: the aligner's text kinds (`CHUNK_1_1` .. `CHUNK_N_M`: both
sides cover byte-equal content text), `CHUNK_OPEN` (the two turn-open markers of one message) or
`CHUNK_EOT` (the two end-of-turn runs after one message: whitespace the template puts before its
close token, if any, and the token). Marker chunks are never text-aligned.

Straddling tokens: a token whose bytes cross a content's edge (it merges content with template
text) belongs to no chunk. A content's text chunks run between the first and the last byte
positions inside the content that are token boundaries on **both** sides, so chunk text stays
byte-equal; the tokens outside that range on either side get chunk -1 (`PairChunks.loose`
counts them). A straddling token of an assistant content is still trained (CE): the student has
to produce it to say the content.

The end-of-turn event, for the trainer: at an EOT chunk the student's probability of stopping is
the chain probability of its run (usually one token, its end-of-turn id) at that position, the
teacher's the same for its own run; the KD term is the binary KL between the two Bernoullis
(stop here / go on), KL(p_t || p_s) = p_t log(p_t / p_s) + (1 - p_t) log((1 - p_t) / (1 - p_s)).
No vocabulary projection is needed: each model's own marker carries the event.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.chat import rows
from pipelines.chat.backend import Tokenizer, align_flat
from pipelines.chat.encode import RenderedTokens, SpecialMatcher, encode_renderings
from pipelines.chat.markers import TOKEN_CONTENT, TemplateMarkers, layout, markers_from_probe
from pipelines.chat.render import Rendering, render_conversation
from pipelines.chat.rows import Conversation, DeadLetter, Message
from pipelines.chat.templates import ChatTemplate
from pipelines.chat.train import train_flags

CHUNK_OPEN, CHUNK_EOT = 4, 5  # chunk kinds beyond the aligner's 0..3 (text chunks)

_PROBE = (
    ("system", "You answer questions about plays."),
    ("user", "Who speaks first?"),
    ("assistant", "Bernardo speaks first."),
    ("user", "And then?"),
    ("assistant", "Francisco answers him."),
)


@dataclass(frozen=True)
class ChatSide:
    """One tokenizer with its template, prepared once (`prepare_side`)."""

    name: str
    tokenizer: Tokenizer
    template: ChatTemplate
    matcher: SpecialMatcher
    markers: TemplateMarkers
    bos_token: str
    eos_token: str

    def to_json(self) -> dict:
        """What stats.json records for this side."""
        return {
            "tokenizer": self.tokenizer.info().to_json(),
            "template": self.template.to_json(),
            "markers": self.markers.to_json(self.tokenizer),
        }

    def render(self, conv: Conversation) -> Rendering | DeadLetter:
        return render_conversation(
            conv, self.template, bos_token=self.bos_token, eos_token=self.eos_token, side=self.name
        )


def _probe(with_system: bool) -> Conversation:
    msgs = _PROBE if with_system else _PROBE[1:]
    return Conversation(tuple(Message(r, c, r == "assistant") for r, c in msgs))


def prepare_side(tokenizer: Tokenizer, template: ChatTemplate, *, name: str = "") -> ChatSide:
    """Control-token matcher and turn markers of `template` on `tokenizer`, from a probe."""
    name = name or tokenizer.name
    special = tokenizer.special_content
    bos = special(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = special(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    side = ChatSide(name, tokenizer, template, SpecialMatcher(None, {}), None, bos, eos)
    probe = side.render(_probe(True))
    if isinstance(probe, DeadLetter):  # e.g. a template that drops or refuses system turns
        probe = side.render(_probe(False))
    if isinstance(probe, DeadLetter):
        raise ValueError(
            f"{name}: chat template {template.name!r} ({template.source}) cannot render a plain "
            f"user/assistant conversation: {probe.reason}: {probe.detail}"
        )
    scaffolding = "".join(
        probe.text[a:b] for a, b in zip([0, *probe.spans[:, 1]], [*probe.spans[:, 0], None])
    )
    matcher = SpecialMatcher.build(tokenizer, [template.text, bos, eos, scaffolding])
    tokens = encode_renderings(tokenizer, matcher, [probe])[0]
    markers = markers_from_probe(tokens, probe.text)
    return ChatSide(name, tokenizer, template, matcher, markers, bos, eos)


@dataclass(frozen=True)
class SideTokens:
    """One side of one conversation."""

    text: str  # the rendering
    spans: np.ndarray  # int64 [m, 2]: char span of each message's content in text
    ids: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n, 2]: char offsets into text
    byte_offsets: np.ndarray  # int64 [n, 2]: into text's UTF-8 (bits per byte counts these)
    message: np.ndarray  # int32 [n]: message index (turn), -1 between turns
    role: np.ndarray  # int8 [n]: rows.ROLE_ID of that message, -1
    kind: np.ndarray  # int8 [n]: markers.TOKEN_* (scaffold, content, open, close)


@dataclass(frozen=True)
class PairChunks:
    """The chunks of one (student, teacher) pair in one conversation."""

    student_chunk: np.ndarray  # int32 [n_s], -1 = no chunk
    teacher_chunk: np.ndarray  # int32 [n_t]
    n_chunks: int
    chunk_kind: np.ndarray  # int8 [C]: CHUNK_1_1 .. CHUNK_N_M, CHUNK_OPEN, CHUNK_EOT
    chunk_message: np.ndarray  # int32 [C]
    chunk_exact: np.ndarray  # bool [C]
    fallback_regions: int
    loose: int  # content tokens (both sides) left outside every chunk (straddles)


@dataclass(frozen=True)
class ChatAlignment:
    student: SideTokens
    train: np.ndarray  # bool [n_s]: token is a training target (see pipelines.chat.train)
    teachers: tuple[SideTokens, ...]
    pairs: tuple[PairChunks, ...]  # per teacher


def _side_tokens(conv, r: Rendering, tok: RenderedTokens, lay) -> SideTokens:
    roles = np.array([rows.ROLE_ID[m.role] for m in conv.messages], np.int8)
    role = np.where(lay.message >= 0, roles[np.maximum(lay.message, 0)], -1).astype(np.int8)
    return SideTokens(
        r.text, r.spans, tok.ids, tok.offsets, tok.byte_offsets, lay.message, role, lay.kind
    )


def _common_range(s: RenderedTokens, ls, t: RenderedTokens, lt, k: int):
    """Token ranges on both sides of message k's text chunks: [a, b) of the content's bytes
    bounded by boundaries common to both sides (module docstring), or None."""
    s0, s1 = ls.inside[k]
    t0, t1 = lt.inside[k]
    if s1 <= s0 or t1 <= t0:
        return None
    sb = s.byte_offsets[s0:s1] - s.span_bytes[k, 0]
    tb = t.byte_offsets[t0:t1] - t.span_bytes[k, 0]
    length = s.span_bytes[k, 1] - s.span_bytes[k, 0]
    if sb[0, 0] == 0 == tb[0, 0] and sb[-1, 1] == length == tb[-1, 1]:
        return (s0, s1, t0, t1, 0)
    starts = np.intersect1d(sb[:, 0], tb[:, 0])
    ends = np.intersect1d(sb[:, 1], tb[:, 1])
    if not starts.size or not ends.size or ends[-1] <= starts[0]:
        return None
    a, b = int(starts[0]), int(ends[-1])
    ss = s0 + np.searchsorted(sb[:, 0], a), s0 + np.searchsorted(sb[:, 1], b, side="right")
    ts = t0 + np.searchsorted(tb[:, 0], a), t0 + np.searchsorted(tb[:, 1], b, side="right")
    return (int(ss[0]), int(ss[1]), int(ts[0]), int(ts[1]), a)


def _align_pair(convs, s_toks, s_lays, t_toks, t_lays, s_tab, t_tab) -> list[PairChunks]:
    """Every message of every conversation as one row of one aligner call, then per
    conversation the chunk ids with marker chunks in between (module docstring)."""
    rows_, ids_s, bo_s, ids_t, bo_t, ll_s, ll_t = [], [], [], [], [], [], []
    for c, conv in enumerate(convs):
        s, t = s_toks[c], t_toks[c]
        for k in range(len(conv.messages)):
            r = _common_range(s, s_lays[c], t, t_lays[c], k)
            if r is None:
                continue
            a0, a1, b0, b1, a = r
            rows_.append((c, k, a0, a1, b0, b1))
            ids_s.append(s.ids[a0:a1])
            ids_t.append(t.ids[b0:b1])
            bo_s.append(s.byte_offsets[a0:a1] - (s.span_bytes[k, 0] + a))
            bo_t.append(t.byte_offsets[b0:b1] - (t.span_bytes[k, 0] + a))
            ll_s.append(bool(s.lossless[a0:a1].all()))
            ll_t.append(bool(t.lossless[b0:b1].all()))
    splits = lambda parts: np.cumsum([0, *map(len, parts)]).astype(np.int64)  # noqa: E731
    cat = lambda parts, shape: np.concatenate(parts) if parts else np.zeros(shape, np.int64)  # noqa: E731
    res = align_flat(
        student_ids=cat(ids_s, 0),
        student_byte_offsets=cat(bo_s, (0, 2)),
        student_splits=splits(ids_s),
        teacher_ids=cat(ids_t, 0),
        teacher_byte_offsets=cat(bo_t, (0, 2)),
        teacher_splits=splits(ids_t),
        student_lossless=np.array(ll_s, bool),
        teacher_lossless=np.array(ll_t, bool),
        student_bytes=s_tab,
        teacher_bytes=t_tab,
    )
    by_conv: dict[int, dict[int, int]] = {}
    for j, (c, k, *_rest) in enumerate(rows_):
        by_conv.setdefault(c, {})[k] = j
    return [
        _assemble(conv, s_toks[c], s_lays[c], t_toks[c], t_lays[c], res, rows_, by_conv.get(c, {}))
        for c, conv in enumerate(convs)
    ]


def _assemble(conv, s, ls, t, lt, res, rows_, row_of) -> PairChunks:
    s_chunk = np.full(s.ids.size, -1, np.int32)
    t_chunk = np.full(t.ids.size, -1, np.int32)
    kinds, msgs, exact = [], [], []
    fallback = 0
    nxt = 0
    for k in range(len(conv.messages)):
        if ls.open[k] >= 0 and lt.open[k] >= 0:
            s_chunk[ls.open[k]] = t_chunk[lt.open[k]] = nxt
            kinds.append(CHUNK_OPEN), msgs.append(k), exact.append(True)
            nxt += 1
        j = row_of.get(k)
        if j is not None:
            _, _, a0, a1, b0, b1 = rows_[j]
            rs = res.student_chunk[res.student_splits[j] : res.student_splits[j + 1]]
            rt = res.teacher_chunk[res.teacher_splits[j] : res.teacher_splits[j + 1]]
            s_chunk[a0:a1] = np.where(rs >= 0, rs + nxt, -1)
            t_chunk[b0:b1] = np.where(rt >= 0, rt + nxt, -1)
            c0, c1 = int(res.chunk_splits[j]), int(res.chunk_splits[j + 1])
            kinds.extend(res.chunk_kind[c0:c1].tolist())
            exact.extend(res.chunk_exact[c0:c1].tolist())
            msgs.extend([k] * (c1 - c0))
            fallback += int(res.fallback_regions[j])
            nxt += c1 - c0
        if ls.close[k, 0] >= 0 and lt.close[k, 0] >= 0:
            s_chunk[ls.close[k, 0] : ls.close[k, 1]] = nxt
            t_chunk[lt.close[k, 0] : lt.close[k, 1]] = nxt
            kinds.append(CHUNK_EOT), msgs.append(k), exact.append(True)
            nxt += 1
    loose = int(((ls.kind == TOKEN_CONTENT) & (s_chunk < 0)).sum())
    loose += int(((lt.kind == TOKEN_CONTENT) & (t_chunk < 0)).sum())
    return PairChunks(
        s_chunk,
        t_chunk,
        nxt,
        np.array(kinds, np.int8),
        np.array(msgs, np.int32),
        np.array(exact, bool),
        fallback,
        loose,
    )


def align_conversations(
    convs: list[Conversation],
    *,
    student: ChatSide,
    teachers: list[ChatSide],
    train_on: str = rows.TRAIN_ASSISTANT,
) -> list[ChatAlignment | DeadLetter]:
    """Align a batch of conversations (see the module docstring); one result per input."""
    if not teachers:
        raise ValueError("align_conversations needs at least one teacher side")
    sides = [student, *teachers]
    out: list[ChatAlignment | DeadLetter | None] = [None] * len(convs)
    rendered = [[side.render(c) for side in sides] for c in convs]
    live = []
    for i, per_side in enumerate(rendered):
        dead = next((r for r in per_side if isinstance(r, DeadLetter)), None)
        if dead is None:
            live.append(i)
        else:
            out[i] = dead
    lconvs = [convs[i] for i in live]
    toks, lays = [], []
    for j, side in enumerate(sides):
        rs = [rendered[i][j] for i in live]
        tk = encode_renderings(side.tokenizer, side.matcher, rs)
        toks.append(tk)
        lays.append([layout(t, r.text, side.markers) for t, r in zip(tk, rs)])
    pairs = [
        _align_pair(lconvs, toks[0], lays[0], toks[j], lays[j], student.tokenizer, side.tokenizer)
        for j, side in enumerate(teachers, start=1)
    ]
    for n, i in enumerate(live):
        conv = convs[i]
        train = train_flags(conv, lays[0][n], train_on=train_on)
        if not train.any():
            out[i] = DeadLetter(rows.NOTHING_TO_TRAIN, "messages", "no student token is trained")
            continue
        sides_tokens = [
            _side_tokens(conv, rendered[i][j], toks[j][n], lays[j][n]) for j in range(len(sides))
        ]
        out[i] = ChatAlignment(
            sides_tokens[0], train, tuple(sides_tokens[1:]), tuple(p[n] for p in pairs)
        )
    return out
