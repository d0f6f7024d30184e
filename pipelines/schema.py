"""The record schema of aligned shards: the only contract between `pipelines/` and `trainer/`.

One row is one training window of one document. Both sides of a window end at the same
character position (a chunk boundary), so the student's and each teacher's tokens cover exactly
the same text.

Chunk columns: every teacher is aligned to the student on its own, so each teacher i has a pair
of chunk columns: ``teacher{i}_chunk`` (per teacher token) and ``teacher{i}_student_chunk`` (per
student token), plus ``teacher{i}_n_chunks``. A value is the index of the aligned chunk the token
belongs to, counted from 0 within the window and non-decreasing along the row; -1 marks special
tokens (BOS/EOS/pad/chat markers), which are paired by role and never take part in a chunk. Chunk
c of the student and chunk c of teacher i cover identical text; every chunk id in [0, n_chunks)
appears on both sides. (One shared chunking for all teachers would coarsen every pair to the
common refinement of all tokenizers; per-pair columns keep each pair's chunks minimal.)

Teachers are numbered 0..K-1.
The file metadata stores the schema version, the tokenizer fingerprints and the teacher names, so
a reader can refuse shards made with other tokenizers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

SCHEMA_VERSION = 1
COMPLETED_MARKER = "COMPLETED"
STATS_FILE = "stats.json"
DEAD_LETTER_FILE = "dead_letter.jsonl"
SHARD_SUFFIX = ".arrow"

# file-level metadata keys (bytes, as Arrow stores them)
META_SCHEMA_VERSION = b"tokenbridge.schema_version"
META_STUDENT = b"tokenbridge.student"  # json: {"name":..., "fingerprint":..., "vocab_size":...}
META_TEACHERS = b"tokenbridge.teachers"  # json list of the same, in teacher order

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


def shard_schema(student: TokenizerInfo, teachers: list[TokenizerInfo]) -> pa.Schema:
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
    return pa.schema(fields, metadata=meta)


@dataclass(frozen=True)
class ShardMeta:
    schema_version: int
    student: TokenizerInfo
    teachers: list[TokenizerInfo]


def read_meta(schema: pa.Schema, *, where: str = "<schema>") -> ShardMeta:
    """Parse and check the tokenbridge metadata of a shard's Arrow schema."""
    meta = schema.metadata or {}
    if META_SCHEMA_VERSION not in meta:
        raise ValueError(f"{where}: not a tokenbridge shard (no {META_SCHEMA_VERSION.decode()})")
    version = int(meta[META_SCHEMA_VERSION])
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{where}: shard schema version {version}, this code reads version {SCHEMA_VERSION}"
        )
    student = TokenizerInfo.from_json(json.loads(meta[META_STUDENT]))
    teachers = [TokenizerInfo.from_json(t) for t in json.loads(meta[META_TEACHERS])]
    return ShardMeta(version, student, teachers)
