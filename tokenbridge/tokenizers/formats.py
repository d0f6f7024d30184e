"""Loaders for the tokenizer formats `load_tokenizer` accepts, each reduced to one shape (`Loaded`).

HF files go through the `tokenizers` library; GGUF through transformers' conversion plus the
parts of llama.cpp's behaviour it leaves out (`_llama_cpp_fixes`), so our ids equal llama.cpp's;
SentencePiece `.model` through `sentencepiece`; tiktoken rank files (``base64 rank`` per line)
through `tiktoken.Encoding`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenbridge.tokenizers.token_bytes import (
    SPACE_MARK,
    TextBytes,
    byte_level_bytes,
    byte_level_decoder,
    metaspace_bytes,
)

ROLES = ("bos", "eos", "pad", "unk")
PREFIX_NONE, PREFIX_ALWAYS, PREFIX_UNLESS_SPACE = "none", "always", "unless_space"

# llama.cpp pre-tokenizer types that look whole words up in the vocabulary before merging
# (`ignore_merges = true` in llama-vocab.cpp); transformers' GGUF conversion does not set it.
IGNORE_MERGES_PRE = frozenset(
    [
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "minicpm5",
        "youtu",
        "glm4",
        "glm5",
        "tekken",
        "granite-embed-multi-97m",
    ]
)

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*\s+\d+\s*$")


class Backend(Protocol):
    def encode_ids(self, texts: list[str]) -> list[list[int]]: ...

    def encode_offsets(self, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
        """Per text: ids and char offsets int64 [n, 2]."""
        ...


@dataclass
class Loaded:
    backend: Backend
    token_bytes: list[bytes | None]
    specials: dict[int, str]  # id -> content, every special token
    roles: dict[str, int] = field(default_factory=dict)
    prefix: str = PREFIX_NONE
    spellings: list[str | None] | None = None  # id -> the vocabulary's own spelling of the token
    byte_level: bool = False  # every text byte becomes one stand-in; bytes without a token drop


class FormatError(Exception):
    """Raised by loaders; `adapter` maps `kind` to the public error classes."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # "unknown" | "empty" | "no_offsets"


# ---------------------------------------------------------------- HF tokenizers (and GGUF)


class TokenizersBackend:
    def __init__(self, tk):
        tk.no_truncation()  # a saved tokenizer.json may carry truncation: never cut text silently
        tk.no_padding()
        # text is data: "<eos>" written in a document is five characters, never a control token
        # (llama.cpp's parse_special=false; specials are added by role, never parsed from text)
        tk.encode_special_tokens = True
        self.tk = tk

    def encode_ids(self, texts):
        return [e.ids for e in self.tk.encode_batch_fast(texts, add_special_tokens=False)]

    def encode_offsets(self, texts):
        encs = self.tk.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, np.array(e.offsets, dtype=np.int64).reshape(-1, 2)) for e in encs]


def _walk(node: Any):
    """Every dict inside a component's JSON."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _component(c) -> dict:
    return json.loads(c.__getstate__()) if c is not None else {}


def from_tokenizers(tk, roles_by_content: dict[str, str]) -> Loaded:
    """A `tokenizers.Tokenizer` -> Loaded. roles_by_content: role -> token content."""
    norm, pre, dec = _component(tk.normalizer), _component(tk.pre_tokenizer), _component(tk.decoder)
    nodes = [*_walk(norm), *_walk(pre), *_walk(dec)]
    byte_level = any(n.get("type") == "ByteLevel" for n in nodes)
    metaspace = SPACE_MARK in json.dumps([norm, pre, dec], ensure_ascii=False)
    model = tk.model
    byte_fallback = bool(getattr(model, "byte_fallback", False))
    unk = getattr(model, "unk_token", None)
    wp_prefix = model.continuing_subword_prefix if type(model).__name__ == "WordPiece" else None

    def spell(piece: str) -> bytes:
        if byte_level:
            b = byte_level_bytes(piece)
            return b if b is not None else piece.encode("utf-8")
        if metaspace:
            return metaspace_bytes(piece, byte_fallback=byte_fallback)
        if wp_prefix and piece.startswith(wp_prefix):
            return piece[len(wp_prefix) :].encode("utf-8")
        return piece.encode("utf-8")

    vocab = tk.get_vocab(with_added_tokens=True)
    added = tk.get_added_tokens_decoder()
    size = max(vocab.values()) + 1 if vocab else 0
    token_bytes: list[bytes | None] = [None] * size
    spellings: list[str | None] = [None] * size
    specials: dict[int, str] = {}
    for piece, i in vocab.items():
        spellings[i] = piece
        a = added.get(i)
        if (a is not None and a.special) or (a is None and piece == unk):
            specials[i] = piece if a is None else a.content
        elif a is not None:  # an added text token: matched whole, in raw or normalized text
            token_bytes[i] = spell(a.content) if a.normalized and metaspace else a.content.encode()
        else:
            token_bytes[i] = spell(piece)
    roles = {}
    for role, content in roles_by_content.items():
        i = tk.token_to_id(content) if content else None
        if i is not None:
            roles[role] = i
    if unk is not None and "unk" not in roles and tk.token_to_id(unk) is not None:
        roles["unk"] = tk.token_to_id(unk)
    prefix = _prefix_mode(norm, pre)
    return Loaded(
        TokenizersBackend(tk), token_bytes, specials, roles, prefix, spellings, byte_level
    )


def _prefix_mode(norm: dict, pre: dict) -> str:
    if any(n.get("type") == "Prepend" and n.get("prepend") == SPACE_MARK for n in _walk(norm)):
        return PREFIX_ALWAYS
    for n in _walk(pre):
        if n.get("type") == "Metaspace" and (
            n.get("prepend_scheme") in ("first", "always") or n.get("add_prefix_space")
        ):
            return PREFIX_UNLESS_SPACE
        if n.get("type") == "ByteLevel" and n.get("add_prefix_space"):
            return PREFIX_UNLESS_SPACE
    return PREFIX_NONE


def _config_roles(directory: Path) -> dict[str, str]:
    """role -> token content, from tokenizer_config.json / special_tokens_map.json."""
    roles: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        f = directory / name
        if not f.is_file():
            continue
        cfg = json.loads(f.read_text(encoding="utf-8"))
        for role in ROLES:
            v = cfg.get(f"{role}_token")
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                roles[role] = v
    return roles


def load_tokenizer_json(path: Path) -> Loaded:
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tk = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception on bad JSON
        raise FormatError("unknown", f"{path}: not a loadable tokenizer.json ({e})") from e
    return from_tokenizers(tk, _config_roles(path.parent))


def load_gguf(path: Path) -> Loaded:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_SENTENCEPIECE_BUILDERS,
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(str(path))
    n = meta.get("tokenizer.ggml.tokens", 0)
    if not n:
        raise FormatError("empty", f"{path}: GGUF file holds no tokenizer vocabulary")
    arch, d, _cfg = get_gguf_tokenizer(str(path))
    try:
        tk, _ = convert_gguf_tokenizer(arch, d)
    except ValueError as e:
        raise FormatError("unknown", f"{path}: {e}") from e
    tk = _llama_cpp_fixes(tk, arch, d)
    loaded = from_tokenizers(tk, {})
    tokens = d["tokens"]
    # ids past the file's vocabulary are special tokens the conversion invented; specials are
    # never parsed from text (encode_special_tokens), so they cannot be emitted: drop them
    n = len(tokens)
    loaded.token_bytes = loaded.token_bytes[:n]
    loaded.spellings = loaded.spellings[:n]
    loaded.specials = {i: c for i, c in loaded.specials.items() if i < n}
    for role in ROLES:
        key = {"unk": "unk_token_id", "pad": "pad_token_id"}.get(role, f"{role}_token_id")
        i = d.get(key)
        if i is not None and 0 <= i < len(tokens):
            loaded.roles[role] = int(i)
    loaded.roles = {r: loaded.roles[r] for r in ROLES if r in loaded.roles}
    if d.get("tokenizer_type") == "llama" and arch not in GGUF_SENTENCEPIECE_BUILDERS:
        loaded.prefix = PREFIX_ALWAYS if d.get("add_prefix_space", True) else PREFIX_NONE
    return loaded


def _llama_cpp_fixes(tk, arch: str, d: dict):
    """Make the converted tokenizer behave as llama.cpp's for the same file.

    1. Pre-tokenizer types llama.cpp marks `ignore_merges` emit a whole pre-token if it is in the
       vocabulary (Llama-3's tokenizer.json says the same); the conversion loses the flag.
    2. A plain SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`, no architecture-specific
       builder) is tokenized by llama.cpp as: one space prepended (unless the file says
       add_space_prefix = false), every space escaped to ``▁``, no pre-tokenizer split. The
       conversion uses `Metaspace(prepend_scheme="first")`, which differs on leading spaces.
    (The byte-level builder also adds GPT-2's default `<|endoftext|>` when the vocabulary lacks
    it, as an id past the file's vocabulary; `load_gguf` cuts the vocabulary back to the file's.)
    """
    from tokenizers import normalizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_SENTENCEPIECE_BUILDERS

    if d.get("pre_tokenizer_type") in IGNORE_MERGES_PRE and hasattr(tk.model, "ignore_merges"):
        tk.model.ignore_merges = True
    if d.get("tokenizer_type") == "llama" and arch not in GGUF_SENTENCEPIECE_BUILDERS:
        escape = normalizers.Replace(" ", SPACE_MARK)
        prefix = d.get("add_prefix_space", True)
        tk.normalizer = (
            normalizers.Sequence([normalizers.Prepend(SPACE_MARK), escape]) if prefix else escape
        )
        tk.pre_tokenizer = None
    return tk


# ---------------------------------------------------------------- SentencePiece


class SentencePieceBackend:
    def __init__(self, sp):
        self.sp = sp

    def encode_ids(self, texts):
        return self.sp.encode(texts)

    def encode_offsets(self, texts):
        # sentencepiece 0.2.2 reports char offsets itself (its immutable proto is gone)
        rows = self.sp.encode(texts, return_type="offset_mapping")
        return [(r["ids"], np.array(r["offsets"], dtype=np.int64).reshape(-1, 2)) for r in rows]


def load_sentencepiece(path: Path) -> Loaded:
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise FormatError("unknown", f"{path}: not a SentencePiece model ({e})") from e
    proto = sentencepiece_model_pb2.ModelProto.FromString(sp.serialized_model_proto())
    token_bytes: list[bytes | None] = []
    specials: dict[int, str] = {}
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_control(i) or sp.is_unknown(i):
            specials[i] = piece
            token_bytes.append(None)
        else:
            token_bytes.append(metaspace_bytes(piece, byte_fallback=sp.is_byte(i)))
    roles = {}
    for role, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("pad", sp.pad_id())):
        if i >= 0:
            roles[role] = i
    if sp.unk_id() >= 0:
        roles["unk"] = sp.unk_id()
    prefix = PREFIX_ALWAYS if proto.normalizer_spec.add_dummy_prefix else PREFIX_NONE
    spellings = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    return Loaded(SentencePieceBackend(sp), token_bytes, specials, roles, prefix, spellings)


# ---------------------------------------------------------------- tiktoken


class TiktokenBackend:
    def __init__(self, enc, token_bytes: list[bytes | None], specials: dict[int, str]):
        self.enc = enc
        self.piece = [
            b if b is not None else specials.get(i, "").encode() for i, b in enumerate(token_bytes)
        ]

    def encode_ids(self, texts):
        return [self.enc.encode_ordinary(t) for t in texts]

    def encode_offsets(self, texts):
        out = []
        for text, ids in zip(texts, self.encode_ids(texts)):
            lengths = np.array([len(self.piece[i]) for i in ids], dtype=np.int64)
            end = np.cumsum(lengths)
            tb = TextBytes.build([text])
            s, e = tb.bytes_to_chars(end - lengths, end)
            out.append((ids, np.stack([s, e], axis=1)))
        return out


def is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
    lines = head.splitlines()
    if len(head) == 4096:
        lines = lines[:-1]  # may be cut
    lines = [ln for ln in lines if ln.strip()]
    return bool(lines) and all(_TIKTOKEN_LINE.match(ln) for ln in lines)


def load_tiktoken(path: Path) -> Loaded:
    """A tiktoken BPE rank file, with an optional sidecar ``<file>.json``.

    The rank file holds no pre-tokenizer pattern and no special tokens; the sidecar may give
    ``pat_str`` (default: GPT-2's), ``special_tokens`` ({content: id}) and role names
    (``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``: contents).
    """
    import tiktoken

    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise FormatError("unknown", f"{path}:{lineno}: not a tiktoken rank line") from e
    sidecar = path.with_name(path.name + ".json")
    cfg = json.loads(sidecar.read_text(encoding="utf-8")) if sidecar.is_file() else {}
    special_tokens = {str(k): int(v) for k, v in cfg.get("special_tokens", {}).items()}
    enc = tiktoken.Encoding(
        name=path.stem,
        pat_str=cfg.get("pat_str", GPT2_PATTERN),
        mergeable_ranks=ranks,
        special_tokens=special_tokens,
    )
    size = max([*ranks.values(), *special_tokens.values(), -1]) + 1
    token_bytes: list[bytes | None] = [None] * size
    for b, r in ranks.items():
        token_bytes[r] = b
    specials = {i: s for s, i in special_tokens.items()}
    roles = {
        role: special_tokens[cfg[f"{role}_token"]]
        for role in ROLES
        if cfg.get(f"{role}_token") in special_tokens
    }
    # tiktoken has no spelling of its own: use the byte-level one HF would write for these bytes
    stand_in = {b: ch for ch, b in byte_level_decoder().items()}
    spellings = [
        "".join(stand_in[x] for x in b) if b is not None else specials.get(i)
        for i, b in enumerate(token_bytes)
    ]
    backend = TiktokenBackend(enc, token_bytes, specials)
    return Loaded(backend, token_bytes, specials, roles, PREFIX_NONE, spellings)


# ---------------------------------------------------------------- llama.cpp reference tokenizations


def read_llama_cpp_vocab_tests(gguf: Path) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs from llama.cpp's ``<vocab>.gguf.inp`` / ``.out`` files.

    Format (convert_hf_to_gguf_update.py writes it, tests/test-tokenizer-0.cpp reads it): the
    .inp file is every test text followed by ``"\\n__ggml_vocab_test__\\n"``; the .out file has one
    line per text, each id preceded by a space. The ids come from the reference HF tokenizer with
    ``add_special_tokens=False`` and llama.cpp checks them with ``add_special=false``: no BOS/EOS.
    """
    gguf = Path(gguf)
    raw = gguf.with_name(gguf.name + ".inp").read_text(encoding="utf-8")
    texts = raw.split("\n__ggml_vocab_test__\n")
    if texts[-1] != "":
        raise ValueError(f"{gguf}.inp: does not end with the test separator")
    texts = texts[:-1]
    lines = gguf.with_name(gguf.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines[-1] != "":
        raise ValueError(f"{gguf}.out: does not end with a newline")
    lines = lines[:-1]
    if len(lines) != len(texts):
        raise ValueError(f"{gguf}: {len(texts)} texts in .inp but {len(lines)} lines in .out")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]
