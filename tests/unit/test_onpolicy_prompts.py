"""On-policy prompt sources with real tokenizers and data.

`ChatPrompts` on the shipped Shakespeare conversations with SmolLM2's own chat template: each
prompt is the conversation before an assistant turn plus the generation prompt, its reference
the turn's content; held-out conversations and data-parallel ranks are disjoint; a resumed
source draws exactly what the uninterrupted one does, across an epoch (rollouts of these
prompts for a Gemma teacher: `test_onpolicy_realign.py`). `TextPrompts`: prefixes of the shard windows, the rest their reference, resumable.
"""

from __future__ import annotations

import pytest

from bench.common import shakespeare_docs
from tokenbridge import paths
from tokenbridge.alignment.text_shards import write_text_shards
from tokenbridge.formats.shards import open_shards
from tokenbridge.tokenizers import load_tokenizer
from trainer.config.sections import DataConfig
from trainer.data.shard_reader import ShardReader
from trainer.onpolicy.prompts import ChatPrompts, TextPrompts

MESSAGES = paths.REPO_ROOT / "tokenbridge" / "chat" / "data" / "shakespeare_messages.jsonl"


@pytest.fixture(scope="module")
def s_tok(student_dir):
    return load_tokenizer(student_dir)


def _chat(s_tok, student_dir, *, rank=0, size=1, fraction=0.1) -> ChatPrompts:
    data = DataConfig(shards="unused", eval_fraction=fraction, max_student_tokens=512)
    return ChatPrompts(MESSAGES, s_tok, data=data, model_dir=student_dir, template=None,
                       dp_rank=rank, dp_size=size, seed=7)  # fmt: skip


def test_chat_prompts_are_the_history_and_the_generation_prompt(s_tok, student_dir):
    src = _chat(s_tok, student_dir)
    for p in src.next_prompts(6):
        text = s_tok.decode(list(p.ids))
        assert text.endswith("<|im_start|>assistant\n"), text[-80:]
        assert p.messages[-1]["role"] == "user" and p.messages[-1]["content"] in text
        assert "#" in p.key and p.reference  # the dataset's own answer, kept for mixing
        turn = int(p.key.rsplit("#", 1)[1])
        assert turn == len(p.messages)


def test_chat_prompts_split_ranks_and_held_out(s_tok, student_dir):
    a, b = _chat(s_tok, student_dir, rank=0, size=2), _chat(s_tok, student_dir, rank=1, size=2)
    keys_a = {k for k, _, _ in a.train}
    keys_b = {k for k, _, _ in b.train}
    held = {p.key for p in a.held_out(1000)}
    assert keys_a and keys_b and held
    assert not keys_a & keys_b and not (keys_a | keys_b) & held
    assert held == {p.key for p in b.held_out(1000)}  # every rank evaluates the same prompts


def test_chat_prompts_resume_exactly_across_an_epoch(s_tok, student_dir):
    src = _chat(s_tok, student_dir, rank=1, size=4, fraction=0.5)
    n = len(src.train)
    src.next_prompts(n - 2)
    state = src.state_dict()
    want = [(p.key, p.draw, p.ids) for p in src.next_prompts(5)]  # wraps into epoch 1
    again = _chat(s_tok, student_dir, rank=1, size=4, fraction=0.5)
    again.load_state_dict(state)
    assert [(p.key, p.draw, p.ids) for p in again.next_prompts(5)] == want
    assert [d for _, d, _ in want] == [0, 0, 1, 1, 1]


@pytest.fixture(scope="module")
def reader(tmp_path_factory, student_dir):
    out = write_text_shards(tmp_path_factory.mktemp("prompts") / "shards",
                       shakespeare_docs(6, chars=400), student_dir=student_dir,
                       teacher_dirs=[student_dir], max_tokens=48)  # fmt: skip
    return ShardReader(open_shards(out), max_student_tokens=48)


def _text(reader) -> TextPrompts:
    data = DataConfig(shards="unused", shuffle_buffer=4, eval_fraction=0.2)
    return TextPrompts(reader, data=data, prompt_tokens=8, dp_rank=0, dp_size=1, seed=3)


def test_text_prompts_are_window_prefixes_and_resume(reader):
    src = _text(reader)
    first = src.next_prompts(3)
    for p in first:
        assert len(p.ids) == 8 and p.reference
        row = next(i for i in range(reader.num_rows) if _key(reader, i) == p.key)
        whole = [int(x) for x in reader.row(row)["student_ids"]]
        assert list(p.ids) + list(p.reference) == whole
    state = src.state_dict()
    want = [(p.key, p.draw) for p in src.next_prompts(2 * reader.num_rows)]
    again = _text(reader)
    again.load_state_dict(state)
    assert [(p.key, p.draw) for p in again.next_prompts(2 * reader.num_rows)] == want
    held = {p.key for p in src.held_out(100)}
    assert held and not held & {k for k, _ in want}


def _key(reader, row: int) -> str:
    f, i = reader.locate(row)
    t = reader.tables[f]
    return f"{t.column('doc_id')[i].as_py()}/{t.column('window')[i].as_py()}"
