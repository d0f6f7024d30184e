"""Shard streaming: per-rank shares, eval hold-out, bounded shuffle, exact resume, collation.

Shards here are written directly with `tokenbridge.formats.shards` (synthetic 1:1 chunk columns, the
SmolLM2 tokenizer's real fingerprint), so every test runs in milliseconds.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from tokenbridge.formats import shard_schema
from tokenbridge.formats.shards import ShardWriter, open_shards, shard_name, write_completed
from tokenbridge.losses.ops.segments import collate_aligned, shift_targets
from trainer.checkpoint import state_split as checkpoint_state
from trainer.config.sections import DataConfig
from trainer.data.microbatches import IGNORE, MicrobatchLoader, collate
from trainer.data.shard_reader import ShardReader, ShardStream, is_held_out

INFO = shard_schema.TokenizerInfo("smollm2-135m", "f" * 64, 49152)


def synthetic_rows(n: int, *, seed: int = 0, max_len: int = 20) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        m = int(rng.integers(3, max_len + 1))
        ids = rng.integers(3, 1000, m).astype(np.int32)
        chunk = np.arange(m, dtype=np.int32) - 1
        chunk[0] = -1  # BOS
        u = m + int(rng.integers(0, 3))  # a teacher side of another length
        t_chunk = np.minimum(np.arange(u, dtype=np.int32) - 1, m - 2)
        t_chunk[0] = -1
        rows.append(
            {
                "doc_id": f"doc{i // 3}",
                "window": i % 3,
                "char_start": 0,
                "char_end": m,
                "text": f"text {i}",
                "student_ids": ids,
                shard_schema.teacher_ids_column(0): rng.integers(3, 1000, u).astype(np.int32),
                shard_schema.teacher_chunk_column(0): t_chunk,
                shard_schema.teacher_student_chunk_column(0): chunk,
                shard_schema.teacher_n_chunks_column(0): m - 1,
            }
        )
    return rows


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    rows = synthetic_rows(60)
    schema = shard_schema.shard_schema(INFO, [INFO])
    files = {}
    for k, part in enumerate((rows[:25], rows[25:])):
        with ShardWriter(out / shard_name(k, 2), schema) as w:
            w.write_rows(part)
        files[shard_name(k, 2)] = len(part)
    write_completed(out, {"student": INFO.to_json(), "teachers": [INFO.to_json()]}, files=files)
    return open_shards(out, student=INFO, teachers=[INFO]), rows


def stream(shard_set, *, rank=0, size=1, seed=0, buffer=8, frac=0.2) -> ShardStream:
    reader = ShardReader(shard_set, max_student_tokens=64)
    data = DataConfig(shards=str(shard_set.dir), seed=seed, shuffle_buffer=buffer,
                      eval_fraction=frac)  # fmt: skip
    return ShardStream(reader, data=data, dp_rank=rank, dp_size=size)


def test_ranks_partition_the_training_rows_and_never_see_held_out_ones(shards):
    shard_set, rows = shards
    parts = [set(stream(shard_set, rank=r, size=3).rows.tolist()) for r in range(3)]
    held = set(stream(shard_set).eval_rows.tolist())
    assert all(not (a & b) for i, a in enumerate(parts) for b in parts[i + 1 :])
    assert set().union(*parts) | held == set(range(len(rows)))
    assert not held & set().union(*parts)
    assert held == {i for i, r in enumerate(rows) if is_held_out(r["doc_id"], r["window"], 0.2)}
    assert 0 < len(held) < len(rows)


def test_document_split_holds_out_whole_documents(shards):
    """eval_split=document: every window of a held-out document is held out, none trained on."""
    shard_set, rows = shards
    reader = ShardReader(shard_set, max_student_tokens=64)
    data = DataConfig(shards=str(shard_set.dir), shuffle_buffer=8, eval_fraction=0.3,
                      eval_split="document")  # fmt: skip
    st = ShardStream(reader, data=data, dp_rank=0, dp_size=1)
    held_docs = {rows[i]["doc_id"] for i in st.eval_rows.tolist()}
    trained_docs = {rows[i]["doc_id"] for i in st.rows.tolist()}
    assert held_docs and not held_docs & trained_docs
    assert held_docs == {
        r["doc_id"] for r in rows if is_held_out(r["doc_id"], 0, 0.3, by="document")
    }
    assert len(st.eval_rows) == sum(r["doc_id"] in held_docs for r in rows)
    # the window split cuts through documents: some document is on both sides there
    win = stream(shard_set, frac=0.3)
    assert {rows[i]["doc_id"] for i in win.eval_rows.tolist()} & {
        rows[i]["doc_id"] for i in win.rows.tolist()
    }


def test_validation_set_is_apart_from_test_and_training(shards):
    """data.val_fraction: a validation set for choosing hyper-parameters that shares no document
    with the test set or the training rows, and leaves the test set where it was."""
    shard_set, rows = shards
    reader = ShardReader(shard_set, max_student_tokens=64)

    def st(**kw):
        data = DataConfig(shards=str(shard_set.dir), shuffle_buffer=8, eval_fraction=0.3,
                          eval_split="document", **kw)  # fmt: skip
        return ShardStream(reader, data=data, dp_rank=0, dp_size=1)

    plain, test, val = st(), st(val_fraction=0.3), st(val_fraction=0.3, eval_on="val")
    docs = lambda idx: {rows[i]["doc_id"] for i in idx.tolist()}  # noqa: E731
    assert plain.eval_rows.tolist() == test.eval_rows.tolist()  # the test set did not move
    assert docs(val.eval_rows) and not docs(val.eval_rows) & docs(test.eval_rows)
    assert test.rows.tolist() == val.rows.tolist()  # one training set for both
    assert not docs(test.rows) & (docs(val.eval_rows) | docs(test.eval_rows))
    assert len(test.rows) + len(test.eval_rows) + len(val.eval_rows) == len(rows)


def test_eval_rows_follow_the_text_not_the_shard_row_order(shards, tmp_path):
    """An align job with several workers may write the same windows in another order."""
    shard_set, rows = shards
    out = tmp_path / "reordered"
    out.mkdir()
    with ShardWriter(out / shard_name(0, 1), shard_schema.shard_schema(INFO, [INFO])) as w:
        w.write_rows(rows[::-1])
    meta = {"student": INFO.to_json(), "teachers": [INFO.to_json()]}
    write_completed(out, meta, files={shard_name(0, 1): len(rows)})
    reordered = open_shards(out, student=INFO, teachers=[INFO])

    def texts(s):
        st = stream(s)
        return [st.reader.text(int(i)) for i in st.eval_rows]

    held = [r for r in rows if is_held_out(r["doc_id"], r["window"], 0.2)]
    want = [r["text"] for r in sorted(held, key=lambda r: (r["doc_id"], r["window"]))]
    assert texts(shard_set) == texts(reordered) == want


def test_shuffle_is_seeded_bounded_and_balanced(shards):
    shard_set, _ = shards
    a = [stream(shard_set, seed=1).next_row() for _ in range(1)]
    s1, s2, s3 = stream(shard_set, seed=1), stream(shard_set, seed=1), stream(shard_set, seed=2)
    d1 = [s1.next_row() for _ in range(100)]
    assert d1 == [s2.next_row() for _ in range(100)]
    assert d1 != [s3.next_row() for _ in range(100)]
    assert a[0] == d1[0]
    n = len(s1.rows)
    draws = d1 + [s1.next_row() for _ in range(4 * n - len(d1))]
    counts = collections.Counter(draws)
    # every row comes round once per epoch, give or take its time in the 8-row buffer
    assert set(counts) == set(s1.rows.tolist())
    assert all(3 <= c <= 5 for c in counts.values()), counts
    # without a buffer: file order, epoch after epoch
    plain = stream(shard_set, buffer=0)
    assert [plain.next_row() for _ in range(2 * n)] == plain.rows.tolist() * 2


def test_position_resumes_exactly(shards):
    shard_set, _ = shards
    a = stream(shard_set, rank=1, size=2, seed=3)
    for _ in range(37):
        a.next_row()
    state = a.state_dict()
    expected = [a.next_row() for _ in range(25)]
    b = stream(shard_set, rank=1, size=2, seed=3)
    b.load_state_dict(state)
    assert [b.next_row() for _ in range(25)] == expected
    with pytest.raises(ValueError, match="cannot resume"):
        stream(shard_set, rank=0, size=3, seed=3).load_state_dict(state)


def test_loader_state_is_json_and_resumes_microbatches(shards):
    shard_set, _ = shards

    def loader():
        return MicrobatchLoader(
            stream(shard_set, seed=5), micro_batch_size=3, student_pad=2, teacher_pads=[0],
            pad_to_multiple=8,
        )  # fmt: skip

    a = loader()
    next(a)
    doc, tensors = checkpoint_state.split(a.state_dict())
    assert not tensors  # plain values: a checkpoint holds them as JSON, nothing pickled
    want = [next(a).rows for _ in range(4)]
    b = loader()
    b.load_state_dict(checkpoint_state.join(json.loads(json.dumps(doc)), {}))
    assert [next(b).rows for _ in range(4)] == want


def test_collate_matches_the_loss_library_and_pads_with_ignore(shards):
    shard_set, rows = shards
    reader = ShardReader(shard_set, max_student_tokens=64)
    picked = [4, 7, 30]
    mb = collate(
        [reader.row(i) for i in picked], student_pad=2, teacher_pads=[0], pad_to_multiple=8
    )
    ref = collate_aligned([rows[i] for i in picked], teacher=0, student_pad_id=2, teacher_pad_id=0)
    a = mb.aligned[0]
    T, U = ref.student_ids.shape[1], ref.teacher_ids.shape[1]
    assert mb.input_ids_BT.shape[1] % 8 == 0 and a.teacher_ids.shape[1] % 8 == 0
    assert torch.equal(a.student_ids[:, :T], ref.student_ids)
    assert torch.equal(a.student_chunk[:, :T], ref.student_chunk)
    assert torch.equal(a.teacher_ids[:, :U], ref.teacher_ids)
    assert torch.equal(a.teacher_chunk[:, :U], ref.teacher_chunk)
    assert torch.equal(a.n_chunks, ref.n_chunks) and torch.equal(a.teacher_len, ref.teacher_len)
    assert (a.student_chunk[:, T:] == -1).all() and (a.teacher_chunk[:, U:] == -1).all()
    assert (mb.input_ids_BT[:, T:] == 2).all()
    lens = torch.tensor([len(rows[i]["student_ids"]) for i in picked])
    assert torch.equal(mb.targets_BT, shift_targets(mb.input_ids_BT, lens))
    assert IGNORE == -1 and mb.num_targets == int((lens - 1).sum())
    assert torch.equal(mb.attention_mask_BT.sum(1), lens)
    t_in = mb.teacher_inputs(0)
    assert torch.equal(t_in["attention_mask"].sum(1), ref.teacher_len)
    assert mb.texts == [rows[i]["text"] for i in picked]


def test_rows_over_the_limit_are_refused_with_the_directory(shards):
    shard_set, rows = shards
    longest = max(len(r["student_ids"]) for r in rows)
    reader = ShardReader(shard_set, max_student_tokens=longest - 1)
    with pytest.raises(ValueError, match=rf"{longest} student tokens > data.max_student_tokens"):
        reader.max_lengths()
    i = next(i for i, r in enumerate(rows) if len(r["student_ids"]) == longest)
    with pytest.raises(ValueError, match=r"shard-0000\d-of-00002.arrow row \d+"):
        reader.row(i)
    ok = ShardReader(shard_set, max_student_tokens=longest).max_lengths()
    assert ok == (longest, [max(len(r[shard_schema.teacher_ids_column(0)]) for r in rows)])


def test_too_few_rows_for_the_ranks_is_an_error(shards):
    shard_set, _ = shards
    with pytest.raises(ValueError, match="cannot feed 100 data-parallel ranks"):
        stream(shard_set, rank=99, size=100, frac=0.9)
