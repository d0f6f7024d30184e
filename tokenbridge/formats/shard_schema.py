"""The record schema of aligned shards: the only contract between `pipelines/` and `trainer/`.

One row is one training window of one document (or one conversation), and both sides of it end
at the same character. Each teacher has its own chunk columns against the student, so each
pair's chunks stay minimal; the file metadata names every tokenizer, so a reader refuses shards
made with others (columns, values, versions: docs/alignment.md, "The shard row").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 2  # what this code writes
READABLE_SCHEMA_VERSIONS = (1, 2)
COMPLETED_MARKER = "COMPLETED"
STATS_FILE = "stats.json"
DEAD_LETTER_FILE = "dead_letter.jsonl"
SHARD_SUFFIX = ".arrow"

# file-level metadata keys (bytes, as Arrow stores them)
META_SCHEMA_VERSION = b"tokenbridge.schema_version"
META_STUDENT = b"tokenbridge.student"  # json: {"name":..., "fingerprint":..., "vocab_size":...}
META_TEACHERS = b"tokenbridge.teachers"  # json list of the same, in teacher order
META_CHAT = b"tokenbridge.chat"  # json: train mode, per side template + markers (chat shards)

# conversation shards: per-row and per-token columns, train codes, chunk kinds beyond 0..3
MESSAGES_COLUMN = "messages"
TRAINED_BYTES_COLUMN = "trained_bytes"
STUDENT_TRAIN_COLUMN = "student_train"
# a token's train code; a code > 0 makes it a target (the position before it is trained):
# not a target, content of a trained message, its end-of-turn run, other (train mode `all`)
TRAIN_NONE, TRAIN_CONTENT, TRAIN_END_OF_TURN, TRAIN_OTHER = 0, 1, 2, 3
# chunk kinds past the aligner's 0..3 (1:1, 1:N, N:1, N:M): a pair of turn-open markers, a pair
# of end-of-turn runs (each model's own, paired by message, never text-aligned)
CHUNK_OPEN, CHUNK_EOT = 4, 5

PROVENANCE_FIELDS = [
    pa.field("doc_id", pa.string(), nullable=False),
    pa.field("window", pa.int32(), nullable=False),  # index of the window within its document
    pa.field("char_start", pa.int64(), nullable=False),  # span of the window in the document
    pa.field("char_end", pa.int64(), nullable=False),
    pa.field("text", pa.string(), nullable=False),  # the window text, [char_start, char_end)
]


def teacher_ids_column(i: int) -> str:
    return f"teacher{i}_ids"


def teacher_chunk_column(i: int) -> str:
    return f"teacher{i}_chunk"


def teacher_student_chunk_column(i: int) -> str:
    return f"teacher{i}_student_chunk"


def teacher_n_chunks_column(i: int) -> str:
    return f"teacher{i}_n_chunks"


def teacher_train_column(i: int) -> str:
    return f"teacher{i}_train"


def teacher_chunk_kind_column(i: int) -> str:
    return f"teacher{i}_chunk_kind"


@dataclass(frozen=True)
class TokenizerInfo:
    """What a shard remembers of a tokenizer, to refuse mismatches later."""

    name: str
    fingerprint: str
    vocab_size: int

    def to_json(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size}

    @staticmethod
    def from_json(d: dict) -> TokenizerInfo:
        return TokenizerInfo(str(d["name"]), str(d["fingerprint"]), int(d["vocab_size"]))


def shard_schema(
    student: TokenizerInfo, teachers: list[TokenizerInfo], *, chat: dict | None = None
) -> pa.Schema:
    """The schema of a shard: text columns, plus the conversation columns when `chat` (the
    ``tokenbridge.chat`` metadata) is given."""
    if not teachers:
        raise ValueError("an aligned shard needs at least one teacher tokenizer")
    fields = list(PROVENANCE_FIELDS)
    fields += [
        pa.field("student_ids", pa.list_(pa.int32()), nullable=False),
    ]
    for i in range(len(teachers)):
        fields += [
            pa.field(teacher_ids_column(i), pa.list_(pa.int32()), nullable=False),
            pa.field(teacher_chunk_column(i), pa.list_(pa.int32()), nullable=False),
            pa.field(teacher_student_chunk_column(i), pa.list_(pa.int32()), nullable=False),
            pa.field(teacher_n_chunks_column(i), pa.int32(), nullable=False),
        ]
    meta = {
        META_SCHEMA_VERSION: str(SCHEMA_VERSION).encode(),
        META_STUDENT: json.dumps(student.to_json()).encode(),
        META_TEACHERS: json.dumps([t.to_json() for t in teachers]).encode(),
    }
    if chat is not None:
        codes = pa.list_(pa.int8())
        fields += [
            pa.field(MESSAGES_COLUMN, pa.string(), nullable=False),
            pa.field(TRAINED_BYTES_COLUMN, pa.int64(), nullable=False),
            pa.field(STUDENT_TRAIN_COLUMN, codes, nullable=False),
        ]
        for i in range(len(teachers)):
            fields += [
                pa.field(teacher_train_column(i), codes, nullable=False),
                pa.field(teacher_chunk_kind_column(i), codes, nullable=False),
            ]
        meta[META_CHAT] = json.dumps(chat, sort_keys=True).encode()
    return pa.schema(fields, metadata=meta)


@dataclass(frozen=True)
class ShardMeta:
    schema_version: int
    student: TokenizerInfo
    teachers: list[TokenizerInfo]
    chat: dict | None = None  # conversation shards: train mode, templates, markers

    @property
    def is_chat(self) -> bool:
        return self.chat is not None


def check_version(version: int, *, where: str) -> None:
    """Refuse a schema version this code cannot read, saying how to rebuild."""
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(
            f"{where}: shard schema version {version}, this code reads versions "
            f"{list(READABLE_SCHEMA_VERSIONS)}; rebuild the shards with this code "
            "(make align DATA=... OUT=<this directory> ALIGN_ARGS=--overwrite)"
        )


def read_meta(schema: pa.Schema, *, where: str = "<schema>") -> ShardMeta:
    """Parse and check the tokenbridge metadata of a shard's Arrow schema."""
    meta = schema.metadata or {}
    if META_SCHEMA_VERSION not in meta:
        raise ValueError(f"{where}: not a tokenbridge shard (no {META_SCHEMA_VERSION.decode()})")
    version = int(meta[META_SCHEMA_VERSION])
    check_version(version, where=where)
    student = TokenizerInfo.from_json(json.loads(meta[META_STUDENT]))
    teachers = [TokenizerInfo.from_json(t) for t in json.loads(meta[META_TEACHERS])]
    chat = json.loads(meta[META_CHAT]) if META_CHAT in meta else None
    return ShardMeta(version, student, teachers, chat)
