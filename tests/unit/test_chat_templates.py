"""Chat templates (sources, shipped ones, the GGUF metadata) and content spans in renderings."""

from __future__ import annotations

import json

import numpy as np
import pytest

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


def test_a_template_that_rewrites_content_is_refused():
    ok = conv(("user", "Hi"), ("assistant", "Hello"))
    spans_ok(render(ok, TRIM), ok)  # trim of a content without edge spaces is no rewrite
    bad = render(conv(("user", " Hi "), ("assistant", "Hello")), TRIM)
    assert bad.reason == rows.TEMPLATE_REWROTE and "changes with the contents" in bad.detail


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
