"""The tokenizer adapter on real tokenizers: llama.cpp reference ids, the contract, the errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from tokenbridge import paths
from tokenbridge.formats.shard_schema import TokenizerInfo
from tokenbridge.tokenizers import (
    BatchEncoding,
    EmptyTokenizerError,
    NoOffsetsError,
    TokenizerError,
    TokenizerNotFoundError,
    UnknownTokenizerFormatError,
    load_tokenizer,
)
from tokenbridge.tokenizers.formats import read_llama_cpp_vocab_tests


@pytest.mark.parametrize("family", paths.VOCAB_FAMILIES)
def test_ids_equal_llama_cpp_reference(family, vocab_fixture):
    """Every .inp text tokenizes to exactly its .out line (no BOS: see read_llama_cpp_vocab_tests)."""
    gguf = vocab_fixture(family)
    tok = load_tokenizer(gguf)
    cases = read_llama_cpp_vocab_tests(gguf)
    assert len(cases) >= 40
    if tok.bos_id is not None:  # guard against misreading the format: the files carry no BOS
        assert not any(ids[:1] == [tok.bos_id] for _, ids in cases)
    batch = tok.encode_batch([text for text, _ in cases])
    wrong = [
        (text, batch.row(i).ids.tolist(), ids)
        for i, (text, ids) in enumerate(cases)
        if batch.row(i).ids.tolist() != ids
    ]
    assert not wrong, f"{family}: {len(wrong)} texts differ, first: {wrong[0]}"


@pytest.fixture(scope="module")
def smollm2(student_dir):
    return load_tokenizer(student_dir)


@pytest.fixture(scope="module")
def gemma(teacher_dir):
    return load_tokenizer(teacher_dir)


def test_real_pair_vocab_and_roles(gemma, smollm2):
    assert (gemma.vocab_size, smollm2.vocab_size) == (262144, 49152)
    assert gemma.special_ids == {"bos": 2, "eos": 1, "pad": 0, "unk": 3}
    assert smollm2.bos_id == 1 and smollm2.eos_id == 2
    assert {0, 1, 2} <= smollm2.all_special_ids and 2 in gemma.all_special_ids
    tb = gemma.token_bytes()
    assert len(tb) == gemma.vocab_size and tb[gemma.bos_id] is None
    assert gemma.special_content(gemma.bos_id) == "<bos>"
    # spellings reduced to bytes: Gemma's "▁the", SmolLM2's "Ġthe", a byte-fallback piece
    assert tb[gemma.encode(" the").ids[0]] == b" the"
    assert smollm2.token_bytes()[smollm2.encode(" the").ids[0]] == b" the"
    assert b"\xf0" in tb  # Gemma's <0xF0> byte-fallback piece is the single byte
    assert gemma.info() == TokenizerInfo("gemma-3-270m", gemma.fingerprint, 262144)
    assert len(gemma.fingerprint) == 64 and gemma.fingerprint != smollm2.fingerprint


def test_encoding_arrays_and_byte_offsets(gemma, smollm2):
    text = "Caf\u00e9 \U0001f917 1234567\n\n"
    for tok in (gemma, smollm2):
        e = tok.encode(text)
        assert e.ids.dtype == np.int32 and e.offsets.dtype == np.int64
        assert e.offsets.shape == e.byte_offsets.shape == (len(e.ids), 2)
        assert e.lossless
        lengths = tok.token_lengths[e.ids]
        ends = np.cumsum(lengths)
        np.testing.assert_array_equal(e.byte_offsets[:, 1], ends)
        np.testing.assert_array_equal(e.byte_offsets[:, 0], ends - lengths)
        assert tok.decode(e.ids) == text


def test_byte_offsets_split_a_character(smollm2):
    """Byte-level BPE cuts the 4-byte emoji: byte offsets stay exact, char offsets widen."""
    text = "a\U0001f917"
    e = smollm2.encode(text)
    pieces = [smollm2.token_bytes()[i] for i in e.ids]
    assert b"".join(pieces) == text.encode()
    assert any(0 < len(p) < 4 and p[0] >= 0x80 for p in pieces)  # a piece of the emoji alone
    for (bs, be), (cs, ce) in zip(e.byte_offsets, e.offsets):
        assert len(text[:cs].encode()) <= bs and be <= len(text[:ce].encode())


def test_batch_matches_single_and_rows(gemma):
    texts = ["", "Hello world", "  two  spaces ", "\u65e5\u672c\u8a9e", "x" * 300]
    batch = gemma.encode_batch(texts)
    assert isinstance(batch, BatchEncoding) and len(batch) == 5
    assert batch.row_splits.dtype == np.int64 and batch.row_splits[0] == 0
    assert batch.row_splits[-1] == len(batch.ids)
    assert len(batch.row(0).ids) == 0 and batch.lossless[0]
    for b, text in enumerate(texts):
        single, row = gemma.encode(text), batch.row(b)
        np.testing.assert_array_equal(single.ids, row.ids)
        np.testing.assert_array_equal(single.offsets, row.offsets)
        np.testing.assert_array_equal(single.byte_offsets, row.byte_offsets)
    assert gemma.encode_batch([]).row_splits.tolist() == [0]


def test_special_token_text_is_plain_text(gemma, smollm2):
    """ "<eos>" written in a document is characters, never the control token (llama.cpp's
    parse_special=false); roles are added by the caller."""
    for tok, marker in ((gemma, "<eos>"), (smollm2, "<|im_end|>")):
        e = tok.encode(f"end {marker} here")
        assert not set(e.ids.tolist()) & tok.all_special_ids
        assert e.lossless and tok.decode(e.ids) == f"end {marker} here"


def test_dummy_prefix_tokenizers_offsets(vocab_fixture):
    """llama-spm prepends a space: not lossless by definition, but offsets stay exact."""
    tok = load_tokenizer(vocab_fixture("llama-spm"))
    assert tok.adds_prefix_space
    e = tok.encode("Hello world")
    assert not e.lossless
    assert b"".join(tok.token_bytes()[i] for i in e.ids) == b" Hello world"
    assert e.offsets.tolist() == [[0, 5], [5, 11]] == e.byte_offsets.tolist()
    assert tok.decode(e.ids) == "Hello world"


def test_gguf_and_converted_dir_agree(smollm2):
    """The GGUF the student was converted from gives the same vocabulary and the same ids."""
    from tokenbridge.assets.steps import student_gguf

    if not student_gguf().is_file():
        pytest.fail(f"missing asset {student_gguf()}: run `make models` first", pytrace=False)
    from_gguf = load_tokenizer(student_gguf())
    assert from_gguf.fingerprint == smollm2.fingerprint
    assert from_gguf.special_ids == smollm2.special_ids
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler \u2014 1599."
    np.testing.assert_array_equal(from_gguf.encode(text).ids, smollm2.encode(text).ids)


def test_pickles_by_path(smollm2):
    again = pickle.loads(pickle.dumps(smollm2))
    assert again.fingerprint == smollm2.fingerprint and again.path == smollm2.path


def test_decode_rejects_unknown_id(smollm2):
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        smollm2.decode([smollm2.vocab_size])


# ---------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    with pytest.raises(TokenizerNotFoundError, match="no_such_dir") as e:
        load_tokenizer(tmp_path / "no_such_dir")
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, TokenizerError)


def test_unknown_formats(tmp_path):
    prose = tmp_path / "notes.txt"
    prose.write_text("Just some prose, not a tokenizer.\n")
    with pytest.raises(UnknownTokenizerFormatError, match="notes.txt"):
        load_tokenizer(prose)
    (tmp_path / "model_dir").mkdir()
    (tmp_path / "model_dir" / "config.json").write_text("{}")
    with pytest.raises(UnknownTokenizerFormatError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "model_dir")
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"model": "not a model"}')
    with pytest.raises(UnknownTokenizerFormatError, match="not a loadable tokenizer.json"):
        load_tokenizer(broken)


def test_gguf_without_vocabulary_is_empty(tmp_path):
    import gguf

    path = tmp_path / "weights-only.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EmptyTokenizerError, match="no tokenizer vocabulary"):
        load_tokenizer(path)


def test_tokenizer_without_usable_offsets(tmp_path, student_dir):
    """A normalizer that rewrites the whole text leaves tokens that offsets cannot locate."""
    from tokenizers import Regex, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(student_dir / "tokenizer.json"))
    hf.normalizer = normalizers.Replace(Regex(r"[\s\S]+"), "hello world")
    (tmp_path / "rewriter").mkdir()
    hf.save(str(tmp_path / "rewriter" / "tokenizer.json"))
    with pytest.raises(NoOffsetsError, match="rewriter.*no usable offsets"):
        load_tokenizer(tmp_path / "rewriter")
