"""Conversation alignment with real tokenizers and real templates: every invariant, every pair.

Student: SmolLM2-135M-Instruct with its own ChatML template (default system message injected).
Teachers: Gemma-3-270M with the shipped `gemma` and `plain` templates, the Llama-3 vocabulary with
the shipped `llama3` template, Qwen2 and Phi-3 with the templates in their GGUF metadata.
"""

from __future__ import annotations

import numpy as np
import pytest

from tokenbridge.chat import rows, templates
from tokenbridge.chat.align import align_conversations, prepare_side
from tokenbridge.chat.markers import TOKEN_CLOSE, TOKEN_CONTENT, TOKEN_OPEN
from tokenbridge.chat.pairs import CHUNK_EOT, CHUNK_OPEN
from tokenbridge.chat.rows import Conversation, DeadLetter, Message
from tokenbridge.chat.templates import ChatTemplate
from tokenbridge.tokenizers import load_tokenizer

# ---------------------------------------------------------------- sides (loaded once per module)


@pytest.fixture(scope="module")
def smol(student_dir):
    return prepare_side(load_tokenizer(student_dir), templates.resolve_template(student_dir))


def _side(path, override=None):
    return prepare_side(load_tokenizer(path), templates.resolve_template(path, override=override))


@pytest.fixture(scope="module")
def teachers(teacher_dir, vocab_fixture):
    return {
        "gemma": _side(teacher_dir, "gemma"),
        "gemma-plain": _side(teacher_dir, "plain"),
        "llama3": _side(vocab_fixture("llama-bpe"), "llama3"),
        "qwen2": _side(vocab_fixture("qwen2")),
        "phi3": _side(vocab_fixture("phi-3")),
    }


def conv(*pairs) -> Conversation:
    return Conversation(tuple(Message(r, c, r == "assistant") for r, c in pairs))


SINGLE = conv(
    ("user", "Who's there?"), ("assistant", "Nay, answer me: stand, and unfold yourself.")
)
MULTI = conv(
    ("system", "You answer in the words of the play."),
    ("user", "Long live the king!"),
    ("assistant", "Bernardo?"),
    ("user", "He."),
    ("assistant", "You come most carefully upon your hour."),
)
EMPTY_SYSTEM = conv(
    ("system", ""), ("user", "Have you had quiet guard?"), ("assistant", "Not a mouse stirring.")
)
TOOL = conv(
    ("user", "What hour now?"),
    ("tool", '{"clock": "twelve"}'),
    ("assistant", "'Tis now struck twelve."),
)
TRICKY = conv(
    ("user", "user"),  # equal to the role header before it
    ("assistant", "Writes <|im_end|> and <end_of_turn> and <|eot_id|> as text, café ☃ 漢字 🙂."),
    ("user", "\nIndented, with a trailing space "),
    ("assistant", "  Two leading spaces.\n"),
)
CONVS = [SINGLE, MULTI, EMPTY_SYSTEM, TOOL, TRICKY]


# ---------------------------------------------------------------- invariants


def check_pair(res, c: Conversation, student, teacher, p):
    s, t = res.student, res.teachers[p]
    pair = res.pairs[p]
    assert pair.student_chunk.size == s.ids.size and pair.teacher_chunk.size == t.ids.size
    for chunk in (pair.student_chunk, pair.teacher_chunk):
        used = chunk[chunk >= 0]
        assert np.all(np.diff(used) >= 0), "chunk ids go backwards"
        assert set(used.tolist()) == set(range(pair.n_chunks)), "a chunk id is missing on a side"
    assert pair.chunk_kind.size == pair.chunk_message.size == pair.n_chunks
    s_bytes, t_bytes = student.tokenizer.token_bytes(), teacher.tokenizer.token_bytes()
    for ch in range(pair.n_chunks):
        si = np.flatnonzero(pair.student_chunk == ch)
        ti = np.flatnonzero(pair.teacher_chunk == ch)
        k = int(pair.chunk_message[ch])
        kind = int(pair.chunk_kind[ch])
        assert np.all(s.message[si] == k) and np.all(t.message[ti] == k)
        if kind == CHUNK_OPEN:
            assert si.size == ti.size == 1
            assert s.kind[si[0]] == TOKEN_OPEN and t.kind[ti[0]] == TOKEN_OPEN
            continue
        if kind == CHUNK_EOT:
            assert np.all(s.kind[si] == TOKEN_CLOSE) and np.all(t.kind[ti] == TOKEN_CLOSE)
            continue
        # a text chunk: content tokens only, inside message k's content, byte-equal on both sides
        assert np.all(s.kind[si] == TOKEN_CONTENT) and np.all(t.kind[ti] == TOKEN_CONTENT)
        texts = []
        for side, idx, tb in ((s, si, s_bytes), (t, ti, t_bytes)):
            a, b = int(side.byte_offsets[idx[0], 0]), int(side.byte_offsets[idx[-1], 1])
            lo, hi = (len(side.text[:x].encode()) for x in side.spans[k])
            assert lo <= a <= b <= hi, "a text chunk leaves its content"
            chunk = side.text.encode()[a:b]
            assert b"".join(tb[int(i)] for i in side.ids[idx]) == chunk, "tokens != chunk bytes"
            texts.append(chunk)
        assert texts[0] == texts[1], f"chunk {ch} differs: {texts}"


def eot_text(student, res, k):
    lay_close = np.flatnonzero((res.student.kind == TOKEN_CLOSE) & (res.student.message == k))
    return student.tokenizer.decode(res.student.ids[lay_close])


def check_train_round_trip(res, c: Conversation, student, *, last_only=False):
    """Decoded trained student tokens == the assistant contents, each + its end-of-turn; where
    a token straddles the content's start (SmolLM2 merges the header's "\n" with a leading
    space), the trained text starts with that token's scaffolding part."""
    s = res.student
    picked = [k for k, m in enumerate(c.messages) if m.trainable]
    picked = picked[-1:] if last_only else picked
    expected = []
    for k in picked:
        first = np.flatnonzero((s.kind == TOKEN_CONTENT) & (s.message == k))[0]
        head = s.text[s.offsets[first, 0] : s.spans[k, 0]]
        assert head == "" or (head.isspace() and res.pairs[0].student_chunk[first] == -1)
        assert eot_text(student, res, k) == "<|im_end|>"
        expected.append(head + c.messages[k].content + "<|im_end|>")
    assert student.tokenizer.decode(s.ids[res.train]) == "".join(expected)
    return "".join(expected)


def run(convs, student, *teachers, **kw):
    out = align_conversations(list(convs), student=student, teachers=list(teachers), **kw).results()
    assert len(out) == len(convs)
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name", ["gemma", "gemma-plain", "llama3", "qwen2"])
def test_every_conversation_with_every_teacher(smol, teachers, name):
    teacher = teachers[name]
    for c, res in zip(CONVS, run(CONVS, smol, teacher)):
        if name == "gemma" and c is TOOL:  # the shipped gemma template refuses tool turns
            assert res.reason == rows.TEMPLATE_ERROR and res.side == teacher.name
            continue
        assert not isinstance(res, DeadLetter), res
        check_pair(res, c, smol, teacher, 0)
        check_train_round_trip(res, c, smol)
        # both sides close every assistant turn: each one has its end-of-turn pair
        eot = res.pairs[0].chunk_message[res.pairs[0].chunk_kind == CHUNK_EOT]
        assert {k for k, m in enumerate(c.messages) if m.role == "assistant"} <= set(eot.tolist())


def test_phi3_gguf_template(smol, teachers):
    phi3 = teachers["phi3"]
    out = run(
        [
            SINGLE,
            conv(("user", "Hi"), ("assistant", "Hello."), ("user", "And?"), ("assistant", "Bye.")),
        ],
        smol,
        phi3,
    )
    for c, res in zip([SINGLE], out):
        check_pair(res, c, smol, phi3, 0)
        check_train_round_trip(res, c, smol)
    check_pair(
        out[1],
        conv(("user", "Hi"), ("assistant", "Hello."), ("user", "And?"), ("assistant", "Bye.")),
        smol,
        phi3,
        0,
    )
    # Phi-3's template renders no system turn and no tool turn: those rows are refused
    dead = run([MULTI, TOOL], smol, phi3)
    assert [d.reason for d in dead] == [rows.TEMPLATE_DROPPED] * 2
    assert dead[0].field == "messages[0].content" and dead[1].field == "messages[1].content"


def test_markers_learnt_from_the_templates(smol, teachers):
    assert smol.to_json()["markers"] == {"open": ["<|im_start|>"], "close": ["<|im_end|>"]}
    assert teachers["gemma"].to_json()["markers"] == {
        "open": ["<start_of_turn>"],
        "close": ["<end_of_turn>"],
    }
    assert teachers["llama3"].to_json()["markers"]["close"] == ["<|eot_id|>"]
    assert teachers["gemma-plain"].to_json()["markers"] == {"open": [], "close": ["<eos>"]}
    assert set(teachers["phi3"].to_json()["markers"]["open"]) == {"<|user|>", "<|assistant|>"}


def test_injected_system_turn_and_control_text_in_contents(smol, teachers):
    (res,) = run([TRICKY], smol, teachers["gemma"])
    s = res.student
    # SmolLM2's default system turn is scaffolding of no message
    head = s.text[: s.spans[0, 0]]
    assert "You are a helpful AI assistant named SmolLM" in head
    injected = s.offsets[:, 1] <= head.index("<|im_end|>") + len("<|im_end|>")
    assert np.all(s.message[injected] == -1) and np.all(res.pairs[0].student_chunk[injected] == -1)
    # control-token text written in a content is plain text: no special id inside contents
    for side, tok in ((s, smol.tokenizer), (res.teachers[0], teachers["gemma"].tokenizer)):
        inside = side.kind == TOKEN_CONTENT
        assert not np.isin(side.ids[inside], list(tok.all_special_ids)).any()


def test_student_ids_equal_transformers_apply_chat_template(smol, smol_tok):
    for c, res in zip(CONVS, run(CONVS, smol, smol)):
        msgs = [m.as_dict() for m in c.messages]
        if "<|im_end|>" in str(msgs):
            continue  # transformers parses control tokens inside contents; we never do
        ids = smol_tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        assert res.student.ids.tolist() == list(ids)


def test_gemma_ids_equal_the_tokenizers_library_on_the_rendering(teachers, teacher_dir):
    """transformers' apply_chat_template(tokenize=True) = the `tokenizers` library on the
    rendering, control tokens split out; the same for Gemma without loading transformers'."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(teacher_dir / "tokenizer.json"))
    gemma = teachers["gemma"]
    for res in run([SINGLE, MULTI, EMPTY_SYSTEM], gemma, gemma):
        ids = hf.encode(res.student.text, add_special_tokens=False).ids
        assert res.student.ids.tolist() == ids


def test_several_teachers_and_dead_letters_in_one_batch(smol, teachers):
    bad = conv(("system", "x"), ("user", "Hi"), ("assistant", "Yo"))  # phi-3 drops system
    out = run([SINGLE, bad, MULTI], smol, teachers["gemma"], teachers["llama3"], teachers["phi3"])
    assert out[1].reason == rows.TEMPLATE_DROPPED and out[1].side == teachers["phi3"].name
    assert out[2].reason == rows.TEMPLATE_DROPPED
    res = out[0]
    assert len(res.pairs) == len(res.teachers) == 3
    for p, name in enumerate(["gemma", "llama3", "phi3"]):
        check_pair(res, SINGLE, smol, teachers[name], p)


def test_train_modes(smol, teachers):
    g = teachers["gemma"]
    (last,) = run([MULTI], smol, g, train_on=rows.TRAIN_LAST)
    check_train_round_trip(last, MULTI, smol, last_only=True)
    (every,) = run([MULTI], smol, g, train_on=rows.TRAIN_ALL)
    assert every.train.all()
    pc = rows.parse_row(
        {
            "prompt": [
                {"role": "user", "content": "A"},
                {"role": "assistant", "content": "B"},
                {"role": "user", "content": "C"},
            ],
            "completion": "D.",
        },
        fmt=rows.PROMPT_COMPLETION,
    )
    (res,) = run([pc], smol, g)
    assert smol.tokenizer.decode(res.student.ids[res.train]) == "D.<|im_end|>"


STRADDLE = ChatTemplate(
    "colon",
    "file",
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}",
)


def test_straddling_tokens_take_no_chunk(smol, teachers):
    # Qwen2 merges "." with the template's "\n\n" (plain template): the "." of a user content
    qwen_plain = prepare_side(teachers["qwen2"].tokenizer, templates.shipped_template("plain"))
    c = conv(("user", "Who is there."), ("assistant", "Bernardo."))
    (res,) = run([c], smol, qwen_plain)
    check_pair(res, c, smol, qwen_plain, 0)
    t = res.teachers[0]
    merged = [i for i in range(t.ids.size) if t.text[t.offsets[i, 0] : t.offsets[i, 1]] == ".\n\n"]
    assert merged and res.pairs[0].teacher_chunk[merged[0]] == -1 and res.pairs[0].loose > 0
    # a student whose template glues " word" to "assistant:": the token is trained, not chunked
    student = prepare_side(smol.tokenizer, STRADDLE)
    c = conv(("user", "Who?"), ("assistant", "Bernardo said so."))
    (res,) = run([c], student, teachers["gemma"])
    check_pair(res, c, student, teachers["gemma"], 0)
    decoded = student.tokenizer.decode(res.student.ids[res.train])
    assert decoded == " Bernardo said so.<|im_end|>"


def test_nothing_to_align_is_not_an_error(smol, teachers):
    # an empty system content gives no text chunk; the turn markers still pair
    (res,) = run([EMPTY_SYSTEM], smol, teachers["llama3"])
    pair = res.pairs[0]
    assert 0 not in pair.chunk_message[pair.chunk_kind < CHUNK_OPEN].tolist()
    assert pair.chunk_kind[0] == CHUNK_OPEN and pair.chunk_message[0] == 0


def test_the_flat_batch_is_what_the_rows_view(smol, teachers):
    g, l3 = teachers["gemma"], teachers["llama3"]
    batch = align_conversations([SINGLE, TOOL, MULTI], student=smol, teachers=[g, l3])
    assert batch.index.tolist() == [0, 2] and [i for i, _ in batch.dead] == [1]
    s = batch.student
    assert s.token_splits[-1] == s.ids.size == batch.train.size
    for p, t in zip(batch.pairs, batch.teachers):
        assert p.student_chunk.size == s.ids.size and p.teacher_chunk.size == t.ids.size
        assert p.chunk_splits[-1] == p.chunk_kind.size == p.chunk_message.size
    rows_ = [batch.row(b) for b in range(len(batch))]
    assert np.array_equal(np.concatenate([r.student.ids for r in rows_]), s.ids)
    assert np.array_equal(np.concatenate([r.train for r in rows_]), batch.train)
    for p in range(2):
        cat = np.concatenate([r.pairs[p].teacher_chunk for r in rows_])
        assert np.array_equal(cat, batch.pairs[p].teacher_chunk)
    assert batch.results()[1].reason == rows.TEMPLATE_ERROR


# ---------------------------------------------------------------- templates that trim contents

EDGY = conv(  # real-world edge whitespace: spaces, newlines, tabs, an ideographic space
    ("system", "\n  You answer in the words of the play.\t"),
    ("user", " Who's there?\n"),
    ("assistant", "  Nay, answer me: stand, and unfold yourself.\n\n"),
    ("user", "\tLong live the king!"),
    ("assistant", "\n\tBernardo?  "),
    ("user", "\u3000誰だ？ Wer da?\n"),
    ("assistant", "¿Quién vive? You come most carefully upon your hour. \u3000\t\n"),
)


def _core_bytes(side, k: int, content: str) -> tuple[int, int]:
    """Byte span of content k less its edge whitespace, in the side's rendering."""
    core = content.strip().encode()
    a = len(side.text[: side.spans[k, 0]].encode())
    lead = len(content.encode()) - len(content.lstrip().encode())
    start = a + lead - int(side.cut[k, 0])  # the leading whitespace it shows, then the core
    assert side.text.encode()[start : start + len(core)] == core
    return start, start + len(core)


def test_llama3_trims_contents_the_other_side_keeps(smol, teachers, template_fixture):
    """Llama 3.1's official template trims every content; SmolLM2's ChatML keeps it whole. Either
    side as the student: no conversation is refused, every assistant content's trimmed bytes are
    trained, and the text both sides contain is aligned; whitespace only one side sees is in no
    chunk (trained by the student's ordinary rule) and not counted as loose."""
    l31 = templates.named_template(template_fixture("meta-llama-Llama-3.1-8B-Instruct"))
    llama = prepare_side(teachers["llama3"].tokenizer, l31)
    convs = [EDGY, TRICKY, SINGLE, MULTI]
    for student, teacher in ((smol, llama), (llama, smol)):
        for c, res in zip(convs, run(convs, student, teacher)):
            assert not isinstance(res, DeadLetter), res
            check_pair(res, c, student, teacher, 0)
            s, t, pair = res.student, res.teachers[0], res.pairs[0]
            trims = (s if student is llama else t).cut
            assert trims.any() == (c is not SINGLE and c is not MULTI)
            assert not (t if student is llama else s).cut.any()
            loose = 0
            for k, m in enumerate(c.messages):
                chunked = []
                for side, chunk in ((s, pair.student_chunk), (t, pair.teacher_chunk)):
                    a, b = _core_bytes(side, k, m.content)
                    mine = (side.message == k) & (side.kind == TOKEN_CONTENT)
                    over = mine & (side.byte_offsets[:, 0] < b) & (side.byte_offsets[:, 1] > a)
                    # tokens wholly in whitespace this side alone sees: no chunk, not loose
                    assert np.all(chunk[mine & ~over] == -1)
                    loose += int(np.count_nonzero(over & (chunk < 0)))
                    if side is s and m.role == "assistant":  # every trimmed byte is trained
                        covered = np.zeros(b - a, bool)
                        for x, y in side.byte_offsets[res.train & over]:
                            covered[max(x, a) - a : min(y, b) - a] = True
                        assert covered.all(), (k, m.content)
                    if side is s:  # one-side whitespace is trained as the turn's other tokens
                        assert np.all(res.train[mine] == (m.role == "assistant"))
                    done = np.zeros(b - a, bool)
                    for x, y in side.byte_offsets[over & (chunk >= 0)]:
                        done[x - a : y - a] = True
                    chunked.append(done)
                # the same bytes of the trimmed text are chunked on both sides, in one run: all
                # of them but a first / last word glued to whitespace only one side sees
                assert np.array_equal(chunked[0], chunked[1]), (k, m.content)
                at = np.flatnonzero(chunked[0])
                assert at.size == 0 or at.size == at[-1] - at[0] + 1
                words = m.content.strip().encode().split()
                inner = (
                    chunked[0][len(words[0]) : chunked[0].size - len(words[-1])] if words else []
                )
                assert np.all(inner), (k, m.content)
            assert pair.loose == loose
