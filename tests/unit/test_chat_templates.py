"""Chat templates (sources, shipped ones, the GGUF metadata) and content spans in renderings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenbridge import paths
from tokenbridge.chat import rows, templates
from tokenbridge.chat.render import render_conversation
from tokenbridge.chat.rows import Conversation, DeadLetter, Message
from tokenbridge.chat.templates import ChatTemplate, TemplateNotFoundError


def conv(*pairs) -> Conversation:
    return Conversation(tuple(Message(r, c, r == "assistant") for r, c in pairs))


def spans_ok(r, c: Conversation):
    assert not isinstance(r, DeadLetter), r
    assert r.spans.shape == (len(c.messages), 2)
    for (a, b), m in zip(r.spans.tolist(), c.messages):
        assert r.text[a:b] == m.content
    assert np.all(np.diff(r.spans[:, 0]) >= 0)


def render(c, tpl, bos="<s>", eos="</s>"):
    return render_conversation(c, tpl, bos_token=bos, eos_token=eos, side="x")


# ---------------------------------------------------------------- sources


def test_model_dirs_and_ggufs(student_dir, teacher_dir, vocab_fixture):
    smol = templates.model_template(student_dir)
    assert smol.source == templates.TEMPLATE_FILE
    assert "You are a helpful AI assistant named SmolLM" in smol.text
    # the converted dir carries the same template as the GGUF it came from
    gguf = student_dir.parent.parent / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert templates.gguf_chat_template(gguf) == smol.text
    assert templates.model_template(teacher_dir) is None  # Gemma-3-270M base: none
    phi3 = templates.model_template(vocab_fixture("phi-3"))
    assert phi3.source == "gguf" and "<|assistant|>" in phi3.text
    assert templates.model_template(vocab_fixture("gpt-2")) is None
    assert len(smol.sha256) == 64 and smol.to_json()["sha256"] == smol.sha256


def test_no_template_is_an_error_naming_the_options(teacher_dir):
    with pytest.raises(TemplateNotFoundError, match="chatml, gemma, llama3, plain"):
        templates.resolve_template(teacher_dir)
    assert templates.resolve_template(teacher_dir, override="gemma").source == "shipped"
    with pytest.raises(TemplateNotFoundError, match="neither a file nor"):
        templates.resolve_template(teacher_dir, override="vicuna")


def test_override_file_and_config_forms(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    tpl = templates.resolve_template(tmp_path, override=tmp_path / "t.jinja")
    assert (tpl.name, tpl.source) == ("t.jinja", "file")
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": "{{ 'a' }}"}))
    assert templates.model_template(tmp_path).text == "{{ 'a' }}"
    cfg.write_text(json.dumps({"chat_template": [{"name": "default", "template": "D"}]}))
    assert templates.model_template(tmp_path).text == "D"
    cfg.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(TemplateNotFoundError, match="no 'default'"):
        templates.model_template(tmp_path)
    (tmp_path / templates.TEMPLATE_FILE).write_text("J")  # the .jinja file wins
    assert templates.model_template(tmp_path).source == templates.TEMPLATE_FILE


def test_copy_gguf_template(tmp_path, vocab_fixture):
    out = templates.copy_gguf_template(vocab_fixture("qwen2"), tmp_path)
    assert out == tmp_path / templates.TEMPLATE_FILE
    assert templates.model_template(tmp_path).text == templates.gguf_chat_template(
        vocab_fixture("qwen2")
    )
    assert templates.copy_gguf_template(vocab_fixture("qwen2"), tmp_path) == out  # idempotent
    with pytest.raises(ValueError, match="differs"):
        templates.copy_gguf_template(vocab_fixture("phi-3"), tmp_path)
    assert templates.copy_gguf_template(vocab_fixture("gpt-2"), tmp_path / "x") is None


def test_render_equals_transformers_apply_chat_template(smol_tok, student_dir):
    c = conv(("user", "Who's there?"), ("assistant", "Nay, answer me."))
    ours = templates.render(
        templates.model_template(student_dir),
        [m.as_dict() for m in c.messages],
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    assert ours == smol_tok.apply_chat_template([m.as_dict() for m in c.messages], tokenize=False)


# ---------------------------------------------------------------- spans


@pytest.mark.parametrize("name", templates.SHIPPED)
def test_shipped_templates_locate_every_content(name):
    tpl = templates.shipped_template(name)
    for c in [
        conv(("user", "Hi"), ("assistant", "Hello.")),
        conv(
            ("system", ""), ("user", "Q?"), ("assistant", "A."), ("user", "B"), ("assistant", "C")
        ),
        conv(("system", "Be brief."), ("user", "Q"), ("assistant", "A")),
    ]:
        spans_ok(render(c, tpl), c)


def test_smollm2_injects_a_system_turn_as_scaffolding(student_dir):
    tpl = templates.model_template(student_dir)
    c = conv(("user", "user"), ("assistant", "assistant"))  # contents equal to role headers
    r = render(c, tpl)
    spans_ok(r, c)
    assert r.text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    # a search would find the header "user" first; the markers do not
    assert r.text[r.spans[0, 0] - 1] == "\n" and r.text.find("user") < r.spans[0, 0]


def test_gguf_templates(vocab_fixture):
    phi3 = templates.model_template(vocab_fixture("phi-3"))
    c = conv(("user", "Hi"), ("assistant", "Hello"))
    spans_ok(render(c, phi3), c)
    dropped = render(conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Yo")), phi3)
    assert dropped.reason == rows.TEMPLATE_DROPPED
    assert dropped.field == "messages[0].content" and dropped.side == "x"
    qwen = templates.model_template(vocab_fixture("qwen2"))
    r = render(c, qwen)
    spans_ok(r, c)
    assert "You are a helpful assistant" in r.text[: r.spans[0, 0]]


TRIM = ChatTemplate(
    "trim", "file", "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}"
)
EDGES = {  # name -> (filter, what the model sees of a content)
    "trim": ("trim", str.strip),
    "lstrip": ("string).lstrip(", str.lstrip),  # a method call: `(content | string).lstrip()`
    "rstrip": ("string).rstrip(", str.rstrip),
}
# leading/trailing spaces, newlines, tabs, an ideographic space (3 UTF-8 bytes), a content of
# whitespace only, an empty one, and one with inner whitespace only
WHITESPACE = conv(
    ("system", "\n\tBe brief.  "),
    ("user", "  Who's there?\n"),
    ("assistant", "\n\nNay, answer me:\tstand. \u3000"),
    ("user", " \n "),
    ("assistant", "Long  live\n\nthe king!"),
    ("user", ""),
    ("assistant", "\t"),
)


def _edge_template(name: str) -> ChatTemplate:
    f = EDGES[name][0]
    write = "m['content'] | trim" if f == "trim" else f"(m['content'] | {f})"
    return ChatTemplate(name, "file", "{% for m in messages %}<{{ m.role }}>\n{{ " + write +
                        " }}<end>\n{% endfor %}")  # fmt: skip


@pytest.mark.parametrize("name", sorted(EDGES))
def test_edge_whitespace_left_out_is_located_byte_for_byte(name):
    shown = EDGES[name][1]
    r = render(WHITESPACE, _edge_template(name))
    assert not isinstance(r, DeadLetter), r
    for (a, b), (lead, trail), m in zip(r.spans.tolist(), r.cut.tolist(), WHITESPACE.messages):
        seen = shown(m.content)
        assert r.text[a:b] == seen
        assert r.text[a - 1] == "\n" and r.text[b : b + 5] == "<end>"  # nothing else moved
        # the bytes left out, leading and trailing, are the content's edges
        raw = m.content.encode()
        assert raw[lead : len(raw) - trail] == seen.encode() or seen == ""
        assert lead + trail + len(seen.encode()) == len(raw)
    assert r.cut[2].tolist() == {"trim": [2, 4], "lstrip": [2, 0], "rstrip": [0, 4]}[name]


def test_official_templates_that_trim(template_fixture):
    """Llama 3.1/3.2 and Gemma 2 as their models ship them: each content is located as the
    template writes it, trimmed; a tool result Llama writes as JSON is another rewrite."""
    c = Conversation(WHITESPACE.messages[1:5])  # Gemma 2: no system turn, user first
    for model in paths.TEMPLATE_MODELS:
        tpl = templates.named_template(template_fixture(model))
        r = render(c, tpl, bos="<bos>")
        assert not isinstance(r, DeadLetter), (model, r)
        for (a, b), m in zip(r.spans.tolist(), c.messages):
            assert r.text[a:b] == m.content.strip()
        assert r.cut.tolist() == [[2, 1], [2, 4], [3, 0], [0, 0]]
    llama = templates.named_template(template_fixture(paths.TEMPLATE_MODELS[0]))
    s = render(WHITESPACE, llama)  # the system text too: Llama writes it after its own header
    assert s.text[s.spans[0, 0] : s.spans[0, 1]] == "Be brief." and s.cut[0].tolist() == [2, 2]
    tool = render(conv(("user", "Temp?"), ("tool", 'Says "12 C"'), ("assistant", "Mild.")), llama)
    assert tool.reason == rows.TEMPLATE_REWROTE and "not verbatim" in tool.detail


def test_other_rewrites_and_ambiguous_whitespace_are_refused():
    ok = conv(("user", "Hi"), ("assistant", "Hello"))
    spans_ok(render(ok, TRIM), ok)  # trim of a content without edge spaces is no rewrite
    assert render(ok, TRIM).cut is None
    for write in (
        "m.content | trim | replace('\t', ' ')",  # inside the markers too
        "m.content | trim }}{% if m.content.startswith(' ') %}!{% endif %}{{ ''",
    ):
        both = ChatTemplate("trim+", "file", "{% for m in messages %}<{{ m.role }}>{{ " + write +
                            " }}{% endfor %}")  # fmt: skip
        bad = render(conv(("user", " Hi\tthere "), ("assistant", "Hello")), both)
        assert bad.reason == rows.TEMPLATE_REWROTE, write
    assert (
        "changes with the contents" in bad.detail
        and "verbatim or less edge whitespace" in bad.detail
    )
    dots = ChatTemplate(
        "dots", "file", "{% for m in messages %}{{ m.content.strip('.') }}|{% endfor %}"
    )
    assert render(conv(("assistant", "..Yes..")), dots).reason == rows.TEMPLATE_REWROTE
    # untrimmed "a " then a trimmed " b" around one space: which side owns which space?
    amb = ChatTemplate(
        "amb",
        "file",
        "{% for m in messages %}{{ m.content if loop.first else m.content | trim }} {% endfor %}",
    )
    dead = render(conv(("user", "a "), ("assistant", " b")), amb)
    assert dead.reason == rows.TEMPLATE_REWROTE and "ambiguous" in dead.detail
    spans_ok(
        render(conv(("user", "a"), ("assistant", " b")), amb),
        conv(("user", "a"), ("assistant", "b")),
    )


def test_content_dependent_templates_are_refused():
    peek = ChatTemplate(
        "peek",
        "file",
        "{% for m in messages %}{% if m['content'].startswith('Hi') %}!{% endif %}"
        "{{ m['content'] }}{% endfor %}",
    )
    assert render(conv(("user", "Hi"), ("assistant", "x")), peek).reason == rows.TEMPLATE_REWROTE
    twice = ChatTemplate("twice", "file", "{% for m in messages %}{{ m.content * 2 }}{% endfor %}")
    assert render(conv(("assistant", "x")), twice).reason == rows.TEMPLATE_REWROTE
    cut = ChatTemplate("cut", "file", "{% for m in messages %}{{ m.content[:3] }}{% endfor %}")
    assert render(conv(("assistant", "abcdef")), cut).reason == rows.TEMPLATE_REWROTE


def test_a_template_that_raises_is_a_template_error():
    gemma = templates.shipped_template("gemma")
    dead = render(conv(("user", "Weather?"), ("tool", "12 C"), ("assistant", "Mild.")), gemma)
    assert dead.reason == rows.TEMPLATE_ERROR and "role tool is not supported" in dead.detail


def test_contents_with_marker_characters_use_other_markers():
    c = conv(("user", "\U000f0001\U000f0002 odd"), ("assistant", "fine\ue000"))
    spans_ok(render(c, templates.shipped_template("chatml")), c)


# ---------------------------------------------------------------- one render when safe

LOOKS = {
    "trim": "{% for m in messages %}{{ m['content'] | trim }}{% endfor %}",
    "test": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "slice": "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
    "get": "{% for m in messages %}{{ m.get('content') }}{% endfor %}",
    "variable": "{% for m in messages %}{% set c = m.content %}{{ c }}{% endfor %}",
    "computed key": "{% for m in messages %}{% for k in m %}{{ m[k] }}{% endfor %}{% endfor %}",
    "filter block": "{% for m in messages %}{% filter upper %}{{ m.content }}{% endfilter %}{% endfor %}",
    "attribute": "{{ messages | map(attribute='content') | join }}",
}


@pytest.mark.parametrize("name", sorted(LOOKS))
def test_templates_that_look_at_contents_are_not_transparent(name):
    assert not templates.content_transparent(ChatTemplate(name, "file", LOOKS[name]))


def test_transparent_templates_render_once_with_the_same_result(student_dir, vocab_fixture):
    found = [templates.model_template(student_dir)]
    found += [templates.model_template(vocab_fixture(f)) for f in ("phi-3", "qwen2")]
    indexed = "{% for m in messages %}{{ '<' ~ m.role ~ '>' ~ messages[loop.index0]['content'] }}{% endfor %}"
    found += [templates.shipped_template(n) for n in templates.SHIPPED]
    found += [
        ChatTemplate("indexed", "file", indexed),
        ChatTemplate("json", "file", "{{ messages | tojson }}"),
    ]
    convs = [
        conv(("user", "Hi"), ("assistant", "Hello.")),
        conv(
            ("system", ""),
            ("user", ' "Q" \n'),
            ("assistant", "A."),
            ("user", "B"),
            ("assistant", "C"),
        ),
        conv(("user", "user"), ("tool", "12"), ("assistant", "  x ")),
    ]
    for tpl in found:
        assert templates.content_transparent(tpl), tpl.name
        for c in convs:
            kw = {"bos_token": "<s>", "eos_token": "</s>", "side": "x"}
            once = render_conversation(c, tpl, transparent=True, **kw)
            twice = render_conversation(c, tpl, transparent=False, **kw)
            if isinstance(twice, DeadLetter):
                assert isinstance(once, DeadLetter) and once.reason in (
                    twice.reason,
                    rows.TEMPLATE_ERROR,
                )
            else:
                assert once.text == twice.text and np.array_equal(once.spans, twice.spans)
