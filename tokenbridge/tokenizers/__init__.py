"""The tokenizer adapter: one interface over HF, GGUF, SentencePiece and tiktoken tokenizers.

`load_tokenizer(path)` returns a `Tokenizer` whose encodings carry ids, character and UTF-8 byte
offsets into the source text, and the bytes of every token, plus the vocabulary's special tokens
and a fingerprint that later stages use to refuse artifacts made with another vocabulary.

- `adapter`: `Tokenizer`, `Encoding` / `BatchEncoding`, `load_tokenizer`, the errors;
- `formats`: one loader per file format, each reduced to the same `Loaded` shape;
- `token_bytes`: the bytes behind token spellings (byte-level, metaspace, byte fallback) and the
  offsets computed from them, vectorised over a batch.

Modules inside this package import each other directly, never through this file, so that
importing one of them never runs this one half-initialised.
"""

from tokenbridge.tokenizers.adapter import (
    BatchEncoding,
    EmptyTokenizerError,
    Encoding,
    NoOffsetsError,
    Tokenizer,
    TokenizerError,
    TokenizerNotFoundError,
    UnknownTokenizerFormatError,
    load_tokenizer,
)

__all__ = [
    "BatchEncoding",
    "EmptyTokenizerError",
    "Encoding",
    "NoOffsetsError",
    "Tokenizer",
    "TokenizerError",
    "TokenizerNotFoundError",
    "UnknownTokenizerFormatError",
    "load_tokenizer",
]
