"""One tokenizer interface over HF tokenizer.json / directories, GGUF, SentencePiece and tiktoken.

Everything downstream (alignment, projection, shards, bits per byte) needs where each token lies
in the text and the exact bytes it stands for, not only ids. Offsets come from the token bytes
where they reassemble the text, else from the backend's own, checked; special tokens are never
parsed from text, so data cannot inject control tokens (docs/alignment.md, "Tokens and their
bytes").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from tokenbridge.formats.shard_schema import TokenizerInfo
from tokenbridge.tokenizers import formats
from tokenbridge.tokenizers.token_bytes import (
    TextBytes,
    VocabTable,
    batch_offsets,
    check_offsets,
    fingerprint,
)

# fewer regular (non-special) tokens than this is a loader that went wrong, not a vocabulary
MIN_REGULAR_TOKENS = 100
_PROBE = "The quick brown fox jumps over the lazy dog 0123456789."


class TokenizerError(ValueError):
    """Base of every tokenizer error."""


class TokenizerNotFoundError(TokenizerError, FileNotFoundError):
    pass


class UnknownTokenizerFormatError(TokenizerError):
    pass


class EmptyTokenizerError(TokenizerError):
    """A tokenizer that loads with only special tokens (transformers 5 saves such a
    tokenizer.json from ``LlamaTokenizerFast(vocab_file=...)``)."""


class NoOffsetsError(TokenizerError):
    """The backend's character offsets cannot locate a row's tokens in its text."""


_ERRORS = {"unknown": UnknownTokenizerFormatError, "empty": EmptyTokenizerError}
_ERRORS["no_offsets"] = NoOffsetsError


@dataclass(frozen=True)
class Encoding:
    """One text, no special tokens added (nor parsed: "<eos>" in a text is plain text)."""

    ids: np.ndarray  # int32 [n]
    offsets: np.ndarray  # int64 [n, 2] character offsets [start, end) into the text
    byte_offsets: np.ndarray  # int64 [n, 2] UTF-8 byte offsets [start, end) into text.encode()
    lossless: bool  # b"".join(token bytes) == text.encode("utf-8")


@dataclass(frozen=True)
class BatchEncoding:
    """Many texts, flat; row b is tokens [row_splits[b], row_splits[b + 1])."""

    ids: np.ndarray  # int32 [N]
    offsets: np.ndarray  # int64 [N, 2] char offsets, relative to each row's text
    byte_offsets: np.ndarray  # int64 [N, 2] byte offsets, relative to each row's text
    row_splits: np.ndarray  # int64 [B + 1]
    lossless: np.ndarray  # bool [B]

    def __len__(self) -> int:
        return len(self.row_splits) - 1

    def row(self, b: int) -> Encoding:
        lo, hi = int(self.row_splits[b]), int(self.row_splits[b + 1])
        return Encoding(
            self.ids[lo:hi], self.offsets[lo:hi], self.byte_offsets[lo:hi], bool(self.lossless[b])
        )


class Tokenizer:
    """A loaded tokenizer; build with `load_tokenizer`. Immutable; pickles by path."""

    def __init__(self, *, name: str, path: Path, loaded: formats.Loaded):
        self.name = name
        self.path = path
        self._backend = loaded.backend
        self._token_bytes = loaded.token_bytes
        self._specials = dict(loaded.specials)
        self._prefix = loaded.prefix
        self._spellings = loaded.spellings
        self.vocab_size = len(loaded.token_bytes)
        self.special_ids = {r: loaded.roles[r] for r in formats.ROLES if r in loaded.roles}
        self.all_special_ids = frozenset(self._specials)
        n_regular = sum(b is not None for b in self._token_bytes)
        if n_regular < MIN_REGULAR_TOKENS:
            raise EmptyTokenizerError(
                f"{path}: tokenizer {name!r} loaded with {n_regular} regular tokens "
                f"({len(self._specials)} special); expected a vocabulary. A known cause: "
                "transformers 5's LlamaTokenizerFast(vocab_file=...) builds an empty tokenizer."
            )
        self._table = VocabTable.build(self._token_bytes)
        # bytes a byte-level vocabulary keeps; others drop nothing we can see
        self._keep_bytes = np.ones(256, dtype=np.bool_)
        if loaded.byte_level:
            singles = [b[0] for b in self._token_bytes if b is not None and len(b) == 1]
            if len(set(singles)) < 256:
                self._keep_bytes[:] = False
                self._keep_bytes[singles] = True
        self.fingerprint = fingerprint(self._token_bytes, self._specials)
        probe = self.encode(_PROBE).ids
        if not len(probe) or all(int(i) in self.all_special_ids for i in probe):
            raise EmptyTokenizerError(
                f"{path}: tokenizer {name!r} turns {_PROBE!r} into {probe.tolist()}: "
                "no regular tokens, the vocabulary did not load"
            )

    # -- attributes of the contract ----------------------------------------------------------

    @property
    def bos_id(self) -> int | None:
        return self.special_ids.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self.special_ids.get("eos")

    @property
    def pad_id(self) -> int | None:
        return self.special_ids.get("pad")

    @property
    def unk_id(self) -> int | None:
        return self.special_ids.get("unk")

    @property
    def adds_prefix_space(self) -> bool:
        """True if the tokenizer prepends a space the text lacks (SentencePiece dummy prefix);
        such rows are never lossless, but their offsets are still exact."""
        return self._prefix != formats.PREFIX_NONE

    @property
    def token_lengths(self) -> np.ndarray:
        """int64 [vocab_size]: byte length of each token, -1 for specials and unused ids."""
        return self._table.length

    def token_bytes(self) -> list[bytes | None]:
        return list(self._token_bytes)

    def token_strings(self) -> list[str | None]:
        """Per id, the token as the vocabulary spells it ("Ġthe", "▁the", "<0x0A>"). Only for
        display and for showing why spellings must not be compared; compare `token_bytes`."""
        if self._spellings is None:
            return [
                b.decode("utf-8", "replace") if b is not None else None for b in self._token_bytes
            ]
        return list(self._spellings)

    def special_content(self, token_id: int) -> str | None:
        return self._specials.get(int(token_id))

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(self.name, self.fingerprint, self.vocab_size)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, path={str(self.path)!r})"

    def __reduce__(self):
        return (load_tokenizer, (str(self.path),))

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str) -> Encoding:
        return self.encode_batch([text]).row(0)

    def encode_batch(self, texts: list[str]) -> BatchEncoding:
        texts = list(texts)
        for b, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"{self.name}: text {b} is {type(t).__name__}, expected str")
        n_rows = len(texts)
        rows = self._backend.encode_ids(texts)
        counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=n_rows)
        row_splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n_tok = int(row_splits[-1])
        ids = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=n_tok)
        if n_tok and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise TokenizerError(
                f"{self.name}: backend emitted an id outside [0, {self.vocab_size})"
            )
        encoded = [t.encode("utf-8") for t in texts]
        n_bytes = np.fromiter(map(len, encoded), dtype=np.int64, count=n_rows)
        byte_base = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(n_bytes, out=byte_base[1:])
        buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        prefix = self._prefix_per_row(texts, n_bytes)
        offsets = np.zeros((n_tok, 2), dtype=np.int64)
        byte_offsets = np.zeros((n_tok, 2), dtype=np.int64)
        fast = np.empty(n_rows, dtype=np.bool_)
        table = self._table
        dropped = batch_offsets(
            ids, row_splits, buf, byte_base, prefix, self._keep_bytes,
            table.length, table.start, table.flat, offsets, byte_offsets, fast,
        )  # fmt: skip
        lossless = fast & (prefix == 0) & (dropped == 0)

        slow = np.flatnonzero(~fast)
        if len(slow):
            tb = TextBytes.build(texts)
            self._slow_rows(texts, slow, ids, row_splits, tb, offsets, byte_offsets, lossless)
        return BatchEncoding(ids, offsets, byte_offsets, row_splits, lossless)

    def _prefix_per_row(self, texts: list[str], n_bytes: np.ndarray) -> np.ndarray:
        if self._prefix == formats.PREFIX_NONE:
            return np.zeros(len(texts), dtype=np.int64)
        if self._prefix == formats.PREFIX_ALWAYS:
            return (n_bytes > 0).astype(np.int64)
        return np.fromiter((bool(t) and t[0] != " " for t in texts), np.int64, count=len(texts))

    def _slow_rows(self, texts, slow, ids, row_splits, tb, offsets, byte_offsets, lossless):
        """Rows whose token bytes do not reassemble the text: the backend's own char offsets."""
        results = self._backend.encode_offsets([texts[b] for b in slow])
        for b, (row_ids, char_offsets) in zip(slow, results):
            lo, hi = int(row_splits[b]), int(row_splits[b + 1])
            text = texts[b]
            if not np.array_equal(np.asarray(row_ids, dtype=np.int64), ids[lo:hi]):
                raise TokenizerError(
                    f"{self.name}: ids with offsets differ from ids without, text {text[:80]!r}"
                )
            parts = [self._token_bytes[int(i)] for i in ids[lo:hi]]
            if all(p is not None for p in parts) and b"".join(parts) == text.encode():
                # e.g. a Metaspace tokenizer that skipped its prefix: still exact by bytes
                ends = np.cumsum([len(p) for p in parts], dtype=np.int64)
                bs, be = ends - [len(p) for p in parts], ends
                base = tb.byte_base[b]
                cs, ce = tb.bytes_to_chars(base + bs, base + be)
                offsets[lo:hi] = np.stack([cs, ce], axis=1) - tb.char_base[b]
                byte_offsets[lo:hi] = np.stack([bs, be], axis=1)
                lossless[b] = True
                continue
            why, uncovered = check_offsets(char_offsets, text)
            if why is None and len(uncovered):
                why = self._not_dropped(text, uncovered)
            if why is not None:
                raise NoOffsetsError(
                    f"tokenizer {self.name!r} ({self.path}) gives no usable offsets: {why}; "
                    f"text {text[:80]!r}"
                )
            offsets[lo:hi] = char_offsets
            byte_offsets[lo:hi] = (
                tb.chars_to_bytes(tb.char_base[b] + char_offsets) - tb.byte_base[b]
            )
            lossless[b] = False

    def _not_dropped(self, text: str, uncovered: np.ndarray) -> str | None:
        """Characters in no token's span are fine if the tokenizer drops them (it makes no token
        for them alone, e.g. a byte missing from a byte-level vocabulary); otherwise the offsets
        do not say where the tokens came from."""
        chars = sorted({text[i] for i in uncovered.tolist()})
        kept = [c for c, ids in zip(chars, self._backend.encode_ids(chars)) if len(ids)]
        if not kept:
            return None
        first = next(i for i in uncovered.tolist() if text[i] in kept)
        return (
            f"{len(uncovered)} characters lie in no token's span although the tokenizer makes "
            f"tokens for them (first at {first}: {text[first : first + 20]!r})"
        )

    # -- decoding ----------------------------------------------------------------------------

    def decode(self, ids) -> str:
        """Token bytes (special tokens as their text) joined and decoded; drops the dummy
        prefix space of tokenizers that add one."""
        parts = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1):
            b = self._token_bytes[i] if 0 <= i < self.vocab_size else None
            if b is None:
                content = self._specials.get(int(i))
                if content is None:
                    raise TokenizerError(f"{self.name}: id {int(i)} is not in the vocabulary")
                b = content.encode()
            parts.append(b)
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self._prefix != formats.PREFIX_NONE and text.startswith(" "):
            text = text[1:]
        return text


# ---------------------------------------------------------------- loading

_CACHE: dict[tuple, Tokenizer] = {}


def _resolve(path: Path) -> tuple[str, Path]:
    """(format, file) for a path; a directory is searched for the files HF and others ship."""
    if not path.exists():
        raise TokenizerNotFoundError(f"{path}: no such tokenizer file or directory")
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return "hf", path / "tokenizer.json"
        if (path / "tokenizer.model").is_file():
            return _sniff(path / "tokenizer.model")
        for pattern, kind in (("*.tiktoken", "tiktoken"), ("*.gguf", "gguf")):
            found = sorted(path.glob(pattern))
            if len(found) == 1:
                return kind, found[0]
        listing = sorted(p.name for p in path.iterdir())[:20]
        raise UnknownTokenizerFormatError(
            f"{path}: directory has no tokenizer.json, tokenizer.model, single *.tiktoken or "
            f"single *.gguf (it holds: {listing})"
        )
    return _sniff(path)


def _sniff(f: Path) -> tuple[str, Path]:
    with open(f, "rb") as fh:
        head = fh.read(64)
    if head[:4] == b"GGUF":
        return "gguf", f
    if head.lstrip()[:1] == b"{":
        return "hf", f
    if formats.is_tiktoken_file(f):
        return "tiktoken", f
    if head[:1] == b"\x0a":  # protobuf field 1 (pieces), as a SentencePiece ModelProto starts
        return "spm", f
    raise UnknownTokenizerFormatError(
        f"{f}: not a tokenizer.json, GGUF, SentencePiece model or tiktoken rank file "
        f"(starts with {head[:16]!r})"
    )


def _name_for(path: Path, file: Path) -> str:
    if path.is_dir() or file.name in ("tokenizer.json", "tokenizer.model"):
        return file.parent.name
    return file.stem


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a HF dir / tokenizer.json / .gguf / SentencePiece .model / tiktoken.

    Loaded tokenizers are cached in memory by file and modification time (they are immutable).
    """
    path = Path(path).absolute()  # absolute: a pickled tokenizer reloads from any cwd
    kind, file = _resolve(path)
    watched = [
        file,
        *(file.parent / n for n in ("tokenizer_config.json", "special_tokens_map.json")),
    ]
    watched.append(file.with_name(file.name + ".json"))
    key = (str(file.resolve()), kind) + tuple(
        (s.st_mtime_ns, s.st_size) for s in (os.stat(w) for w in watched if w.exists())
    )
    if key in _CACHE:
        return _CACHE[key]
    loaders = {
        "hf": formats.load_tokenizer_json,
        "gguf": formats.load_gguf,
        "spm": formats.load_sentencepiece,
        "tiktoken": formats.load_tiktoken,
    }
    try:
        loaded = loaders[kind](file)
    except formats.FormatError as e:
        raise _ERRORS[e.kind](str(e)) from e
    tok = Tokenizer(name=_name_for(path, file), path=path, loaded=loaded)
    if len(_CACHE) >= 16:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = tok
    return tok
