"""Conversations -> per-token arrays per side: ids, chunks, train flags, message and role ids.

`align_conversations` runs a batch through the steps in order: every side renders and locates
the contents (`render`; one side's refusal dead-letters the conversation), tokenizes all its
renderings in one call and finds each message's tokens and markers (`encode`, `markers`), then
each (student, teacher) pair is aligned in one aligner call (`pairs`) and the student's train
flags are set (`train_flags`). Arrays are flat with row splits, what a columnar job writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenbridge.chat import rows
from tokenbridge.chat.encode import RenderedBatch, SpecialMatcher, encode_renderings
from tokenbridge.chat.markers import TemplateMarkers, layout, markers_from_probe
from tokenbridge.chat.pairs import PairBatch, align_pair
from tokenbridge.chat.render import Rendering, render_conversation
from tokenbridge.chat.rows import Conversation, DeadLetter, Message
from tokenbridge.chat.templates import ChatTemplate, content_transparent
from tokenbridge.chat.train_flags import train_flags
from tokenbridge.tokenizers.adapter import Tokenizer

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
    markers: TemplateMarkers | None
    bos_token: str
    eos_token: str
    tables: tuple[np.ndarray, np.ndarray] | None = None  # markers as vocab lookups
    transparent: bool = False  # templates.content_transparent: one render per conversation

    def to_json(self) -> dict:
        """What stats.json records for this side."""
        return {
            "tokenizer": self.tokenizer.info().to_json(),
            "template": self.template.to_json(),
            "markers": self.markers.to_json(self.tokenizer),
            "content_transparent": self.transparent,
        }

    def render(self, conv: Conversation) -> Rendering | DeadLetter:
        return render_conversation(
            conv,
            self.template,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            side=self.name,
            transparent=self.transparent,
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
    edges = zip([0, *probe.spans[:, 1].tolist()], [*probe.spans[:, 0].tolist(), None])
    scaffolding = "".join(probe.text[a:b] for a, b in edges)
    matcher = SpecialMatcher.build(tokenizer, [template.text, bos, eos, scaffolding])
    markers = markers_from_probe(encode_renderings(tokenizer, matcher, [probe]), probe.text)
    tables = markers.tables(tokenizer.vocab_size)
    transparent = content_transparent(template)
    return ChatSide(name, tokenizer, template, matcher, markers, bos, eos, tables, transparent)


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class SideTokens:
    """One side of one conversation (views into a SideBatch)."""

    text: str  # the rendering
    spans: np.ndarray  # int64 [m, 2]: char span of each message's content in text
    ids: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n, 2]: char offsets into text
    byte_offsets: np.ndarray  # int64 [n, 2]: into text's UTF-8 (bits per byte counts these)
    message: np.ndarray  # int32 [n]: message index (turn), -1 between turns
    role: np.ndarray  # int8 [n]: rows.ROLE_ID of that message, -1
    kind: np.ndarray  # int8 [n]: markers.TOKEN_* (scaffold, content, open, close)
    cut: np.ndarray  # int64 [m, 2]: bytes of each content's edge whitespace not in text


@dataclass(frozen=True)
class SideBatch:
    """One side of a batch, flat: conversation b owns tokens [token_splits[b], ...[b + 1])."""

    texts: list[str]
    spans: np.ndarray  # int64 [M, 2] char spans; conversation b owns [span_splits[b], ...)
    span_splits: np.ndarray  # int64 [B + 1]
    ids: np.ndarray  # int32 [N]
    offsets: np.ndarray  # int64 [N, 2]
    byte_offsets: np.ndarray  # int64 [N, 2]
    message: np.ndarray  # int32 [N]
    role: np.ndarray  # int8 [N]
    kind: np.ndarray  # int8 [N]
    token_splits: np.ndarray  # int64 [B + 1]
    cut: np.ndarray  # int64 [M, 2]: UTF-8 bytes of edge whitespace left out (Rendering.cut)

    def row(self, b: int) -> SideTokens:
        lo, hi = int(self.token_splits[b]), int(self.token_splits[b + 1])
        m0, m1 = int(self.span_splits[b]), int(self.span_splits[b + 1])
        return SideTokens(self.texts[b], self.spans[m0:m1], self.ids[lo:hi], self.offsets[lo:hi],
                          self.byte_offsets[lo:hi], self.message[lo:hi], self.role[lo:hi],
                          self.kind[lo:hi], self.cut[m0:m1])  # fmt: skip


@dataclass(frozen=True)
class PairChunks:
    """The chunks of one (student, teacher) pair in one conversation (views)."""

    student_chunk: np.ndarray  # int32 [n_s], -1 = no chunk
    teacher_chunk: np.ndarray  # int32 [n_t]
    n_chunks: int
    chunk_kind: np.ndarray  # int8 [C]: CHUNK_1_1 .. CHUNK_N_M, CHUNK_OPEN, CHUNK_EOT
    chunk_message: np.ndarray  # int32 [C]
    chunk_exact: np.ndarray  # bool [C]
    fallback_regions: int
    loose: int  # tokens over text both sides contain, left outside every chunk (straddles)


@dataclass(frozen=True)
class ChatAlignment:
    """One conversation: the student, its train flags, and per teacher its side and chunks."""

    student: SideTokens
    train: np.ndarray  # bool [n_s]: token is a training target (see tokenbridge.chat.train_flags)
    teachers: tuple[SideTokens, ...]
    pairs: tuple[PairChunks, ...]


@dataclass(frozen=True)
class ChatBatch:
    """`align_conversations`' result: the aligned conversations in flat arrays (what a
    columnar job writes) and the refused ones. index[b] is the input position of row b."""

    index: np.ndarray  # int64 [B]
    student: SideBatch
    train: np.ndarray  # bool [N_s]
    teachers: tuple[SideBatch, ...]
    pairs: tuple[PairBatch, ...]
    dead: tuple[tuple[int, DeadLetter], ...]  # (input position, why)

    def __len__(self) -> int:
        return int(self.index.size)

    def row(self, b: int) -> ChatAlignment:
        lo, hi = int(self.student.token_splits[b]), int(self.student.token_splits[b + 1])
        pairs = []
        for p, t in zip(self.pairs, self.teachers):
            c0, c1 = int(p.chunk_splits[b]), int(p.chunk_splits[b + 1])
            t0, t1 = int(t.token_splits[b]), int(t.token_splits[b + 1])
            pairs.append(PairChunks(p.student_chunk[lo:hi], p.teacher_chunk[t0:t1], c1 - c0,
                                    p.chunk_kind[c0:c1], p.chunk_message[c0:c1],
                                    p.chunk_exact[c0:c1], int(p.fallback_regions[b]),
                                    int(p.loose[b])))  # fmt: skip
        teachers = tuple(t.row(b) for t in self.teachers)
        return ChatAlignment(self.student.row(b), self.train[lo:hi], teachers, tuple(pairs))

    def results(self) -> list[ChatAlignment | DeadLetter]:
        """One entry per input conversation, in input order (tests, small tools)."""
        out: list = [None] * (len(self) + len(self.dead))
        for b, i in enumerate(self.index.tolist()):
            out[i] = self.row(b)
        for i, dead in self.dead:
            out[i] = dead
        return out


def _side_batch(convs, renderings, tok: RenderedBatch, lay) -> SideBatch:
    roles = np.array([rows.ROLE_ID[m.role] for c in convs for m in c.messages], np.int8)
    first = np.repeat(tok.span_splits[:-1], np.diff(tok.token_splits))
    glob = first + np.maximum(lay.message, 0)
    role = np.where(lay.message >= 0, roles[glob] if roles.size else -1, -1).astype(np.int8)
    spans = np.concatenate([r.spans for r in renderings]) if renderings else np.zeros((0, 2))
    return SideBatch([r.text for r in renderings], spans.astype(np.int64), tok.span_splits,
                     tok.ids, tok.offsets, tok.byte_offsets, lay.message, role, lay.kind,
                     tok.token_splits, tok.cut_bytes)  # fmt: skip


def align_conversations(
    convs: list[Conversation],
    *,
    student: ChatSide,
    teachers: list[ChatSide],
    train_on: str = rows.TRAIN_ASSISTANT,
) -> ChatBatch:
    """Align a batch of conversations (see the module docstring)."""
    if not teachers:
        raise ValueError("align_conversations needs at least one teacher side")
    sides = [student, *teachers]
    rendered = [[side.render(c) for c in convs] for side in sides]
    dead: dict[int, DeadLetter] = {}
    for per_side in rendered:  # the student's refusal is reported first
        for i, r in enumerate(per_side):
            if isinstance(r, DeadLetter) and i not in dead:
                dead[i] = r
    live = [i for i in range(len(convs)) if i not in dead]
    lconvs = [convs[i] for i in live]
    batches, toks, lays = [], [], []
    for side, per_side in zip(sides, rendered):
        rs = [per_side[i] for i in live]
        tok = encode_renderings(side.tokenizer, side.matcher, rs)
        lay = layout(tok, side.markers, side.tables)
        toks.append(tok)
        lays.append(lay)
        batches.append(_side_batch(lconvs, rs, tok, lay))
    pairs = tuple(
        align_pair(toks[0], lays[0], toks[j], lays[j],
                   student_bytes=student.tokenizer, teacher_bytes=side.tokenizer)
        for j, side in enumerate(teachers, start=1)
    )  # fmt: skip
    train = train_flags(lconvs, lays[0], train_on=train_on)
    trained = np.add.reduceat(train, toks[0].token_splits[:-1]) if train.size else np.zeros(0)
    if live and (trained == 0).any():  # unreachable: parse_row refuses such rows
        b = int(np.flatnonzero(trained == 0)[0])
        raise ValueError(f"conversation {live[b]}: a trainable turn gave no student token")
    return ChatBatch(np.array(live, np.int64), batches[0], train, tuple(batches[1:]), pairs,
                     tuple(sorted(dead.items())))  # fmt: skip
