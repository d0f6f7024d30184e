"""SentencePiece .model and tiktoken loaders, on fixtures rebuilt from real GGUF vocabularies.

PyPI ships no .model or tiktoken file we may use, so the fixtures are written here from GGUF
vocabularies: a SentencePiece ModelProto from the llama-spm GGUF (pieces, scores, types, BPE,
byte fallback, dummy prefix: what Llama-2's tokenizer.model holds) and a tiktoken rank file from
the gpt-2 GGUF (ranks = ids, bytes from the byte-level spelling). Each loader must reproduce the
GGUF loader and llama.cpp's reference ids, and reduce to the same vocabulary fingerprint.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from tokenbridge.tokenizers import EmptyTokenizerError, load_tokenizer
from tokenbridge.tokenizers.formats import read_llama_cpp_vocab_tests
from tokenbridge.tokenizers.token_bytes import byte_level_bytes


def _gguf_vocab(path):
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens",))
    return meta


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, vocab_fixture):
    from sentencepiece import sentencepiece_model_pb2 as pb

    meta = _gguf_vocab(vocab_fixture("llama-spm"))
    piece_type = pb.ModelProto.SentencePiece.Type
    types = {1: "NORMAL", 2: "UNKNOWN", 3: "CONTROL", 4: "USER_DEFINED", 5: "UNUSED", 6: "BYTE"}
    model = pb.ModelProto()
    for token, score, kind in zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
    ):
        piece = model.pieces.add()
        piece.piece, piece.score, piece.type = token, score, piece_type.Value(types[kind])
    spec = model.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.byte_fallback = True
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = 0, 1, 2, -1
    norm = model.normalizer_spec
    norm.name, norm.add_dummy_prefix = "identity", True
    norm.remove_extra_whitespaces, norm.escape_whitespaces = False, True
    path = tmp_path_factory.mktemp("spm") / "tokenizer.model"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory, vocab_fixture):
    meta = _gguf_vocab(vocab_fixture("gpt-2"))
    lines, specials = [], {}
    for i, (token, kind) in enumerate(
        zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])
    ):
        if kind == 3:  # control: not a rank, a special token
            specials[token] = i
        else:
            lines.append(f"{base64.b64encode(byte_level_bytes(token)).decode()} {i}")
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    sidecar = {
        "special_tokens": specials,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
    }
    path.with_name(path.name + ".json").write_text(json.dumps(sidecar))
    return path


@pytest.mark.parametrize(
    ("fixture", "family"), [("spm_model", "llama-spm"), ("tiktoken_file", "gpt-2")]
)
def test_loader_reproduces_gguf(fixture, family, request, vocab_fixture):
    tok = load_tokenizer(request.getfixturevalue(fixture))
    ref = load_tokenizer(vocab_fixture(family))
    assert tok.fingerprint == ref.fingerprint
    assert tok.vocab_size == ref.vocab_size and tok.special_ids == ref.special_ids
    assert tok.adds_prefix_space == ref.adds_prefix_space
    cases = read_llama_cpp_vocab_tests(vocab_fixture(family))
    texts = [t for t, _ in cases]
    ours, theirs = tok.encode_batch(texts), ref.encode_batch(texts)
    for b, (text, expected) in enumerate(cases):
        assert ours.row(b).ids.tolist() == expected, f"{tok.name} on {text!r}"
    np.testing.assert_array_equal(ours.offsets, theirs.offsets)
    np.testing.assert_array_equal(ours.byte_offsets, theirs.byte_offsets)
    np.testing.assert_array_equal(ours.lossless, theirs.lossless)


def test_sentencepiece_offsets_from_its_offset_mapping(spm_model):
    """A literal "▁" cannot be told from a space: that row takes the proto's own offsets."""
    tok = load_tokenizer(spm_model)
    e = tok.encode("a\u2581b \u65e5")
    assert not e.lossless
    assert e.offsets[:, 0].min() >= 0 and e.offsets[:, 1].max() <= 5
    assert (np.diff(e.offsets[:, 0]) >= 0).all()


def test_tiktoken_is_lossless_on_special_text(tiktoken_file):
    tok = load_tokenizer(tiktoken_file)
    text = "a <|endoftext|> b \U0001f917"
    e = tok.encode(text)
    assert e.lossless and tok.eos_id not in e.ids.tolist()
    assert tok.decode(e.ids) == text


def test_transformers_vocab_file_trap_is_empty(tmp_path, spm_model):
    """transformers 5: LlamaTokenizerFast(vocab_file=...) builds a tokenizer with no vocabulary;
    what it saves must be refused, not used."""
    from transformers import LlamaTokenizerFast

    trap = LlamaTokenizerFast(vocab_file=str(spm_model))
    trap.save_pretrained(tmp_path / "trap")
    with pytest.raises(EmptyTokenizerError, match="0 regular tokens"):
        load_tokenizer(tmp_path / "trap")
