"""The tokenizer adapter: one interface over HF, GGUF, SentencePiece and tiktoken tokenizers.

`load_tokenizer(path)` gives encodings with ids, character and byte offsets and every token's
bytes, plus the special tokens and a vocabulary fingerprint (docs/alignment.md). The modules
inside import each other directly, never through this file, so importing one never runs this
one half-initialised.
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
