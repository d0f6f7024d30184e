"""The teacher cache's files: the Arrow schema, packed ids, log-prob codecs, and `CacheMeta`.

A cache has the shard directory's layout and marker, so the same verification applies. Its rows
are keyed by the shard row they score, ``(shard_file, row)``, not ordered, because the job writes
them in the order its workers finish; top-k ids are bit-packed to the vocabulary's width
(columns: docs/losses.md, "The cache's files").
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa

CACHE_SCHEMA_VERSION = 1
KIND = "teacher_cache"
META_KEY = b"tokenbridge.teacher_cache"  # every file's schema metadata: the CacheMeta json

# stored log-prob dtype -> (Arrow type, numpy dtype of the stored values)
LOGPROB_DTYPES = {
    "float32": (pa.float32(), np.float32),
    "float16": (pa.float16(), np.float16),
    "bfloat16": (pa.uint16(), np.uint16),  # Arrow has no bfloat16: its bits
}


# unit roundoff of each stored log-prob dtype (round to nearest): a stored l is l (1 + d), |d| <= u
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def kl_change_bound(
    kl: float, *, max_abs_logprob: float, k: int, dtype: str, tau: float = 1.0
) -> float:
    """How far tau^2 KL(P || Q), averaged over positions, can move when P's top-k log-probs are
    stored in `dtype` (the tail stays fp32). Each category's probability is then multiplied by
    1 + r, |r| <= eta = exp(u L) - 1 (L = `max_abs_logprob`, the largest |l| stored), so

        |D' - D| <= eta (2 H(P) + D) + (1 + eta) eta / (1 - eta),   H(P) <= log(k + 1)

    per position (docs/losses.md derives it), and the mean moves by at most
    eta KD + tau^2 eta (2 log(k + 1) + (1 + eta) / (1 - eta)) for KD = tau^2 mean D.
    (Subnormal fp16 values below 2^-14 err by less than 2^-25 absolute, inside u L as soon as
    some stored |l| >= 2^-14: every position with k >= 2 has one, log 2.)"""
    eta = math.expm1(UNIT_ROUNDOFF[dtype] * max_abs_logprob)
    return eta * kl + tau**2 * eta * (2 * math.log(k + 1) + (1 + eta) / (1 - eta))


def cache_name(index: int, num_files: int) -> str:
    return f"cache-{index:05d}-of-{num_files:05d}.arrow"


def id_bits(vocab_size: int) -> int:
    """Bits per packed id: enough for ids in [0, vocab_size)."""
    return max(1, int(vocab_size - 1).bit_length())


def pack_ids(ids: np.ndarray, bits: int) -> bytes:
    """Non-negative ids as a little-endian bit stream of `bits`-bit unsigned integers."""
    v = np.ascontiguousarray(ids, dtype=np.int64).ravel()
    if v.size and (v.min() < 0 or v.max() >= 1 << bits):
        raise ValueError(f"ids outside [0, 2^{bits}): {v.min()}..{v.max()}")
    if bits in (8, 16, 32):  # byte-aligned: the same stream, written directly
        return v.astype(f"<u{bits // 8}").tobytes()
    planes = (v[:, None] >> np.arange(bits, dtype=np.int64)) & 1
    return np.packbits(planes.astype(np.uint8).ravel(), bitorder="little").tobytes()


def unpack_ids(buf, bits: int, n: int) -> np.ndarray:
    """`n` ids (int64) from a stream made by `pack_ids`."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size * 8 < n * bits:
        raise ValueError(f"packed ids: {raw.size} bytes cannot hold {n} ids of {bits} bits")
    if bits in (8, 16, 32):
        return raw[: n * bits // 8].view(f"<u{bits // 8}").astype(np.int64)
    if bits > 25:  # a 4-byte window no longer holds every id: go bit by bit
        planes = np.unpackbits(raw, count=n * bits, bitorder="little").reshape(n, bits)
        return (planes.astype(np.int64) << np.arange(bits, dtype=np.int64)).sum(1)
    # each id lies inside the 4 bytes starting at its first byte (bits + 7 <= 32)
    pos = np.arange(n, dtype=np.int64) * bits
    first = pos >> 3
    padded = np.concatenate([raw, np.zeros(4, np.uint8)]).astype(np.int64)
    word = (
        padded[first] | padded[first + 1] << 8 | padded[first + 2] << 16 | padded[first + 3] << 24
    )
    return (word >> (pos & 7)) & ((1 << bits) - 1)


def encode_logprobs(lp: np.ndarray, dtype: str) -> np.ndarray:
    """fp32 log-probs -> the stored values (round to nearest even, as torch casts)."""
    x = np.ascontiguousarray(lp, dtype=np.float32)
    if dtype != "bfloat16":
        return x.astype(LOGPROB_DTYPES[dtype][1])
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def decode_logprobs(values: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values -> fp32 (exact: every fp16 / bf16 value is an fp32 value)."""
    if dtype == "bfloat16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32)


@dataclass(frozen=True)
class CacheMeta:
    """What a cache promises, and what the trainer checks before reading it.

    teacher: ``name``, ``weights`` (`fingerprints.weights_fingerprint`), ``tokenizer`` (the
    tokenizer fingerprint), ``vocab_size`` (its ids), ``dtype`` (the teacher's compute dtype).
    shards: ``fingerprint`` (`fingerprints.shards_fingerprint`), ``teacher_index`` (which
    teacher column of the shards was scored), ``files`` (shard file -> rows).
    """

    teacher: dict
    shards: dict
    k: int
    temperature: float
    logprob_dtype: str = "float16"
    target: bool = True
    samples: int = 0  # R draws per position (0: none)
    sample_seed: int = 0
    chunk: int = 128  # positions per lm_head application (does not change the values)
    version: int = CACHE_SCHEMA_VERSION
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logprob_dtype not in LOGPROB_DTYPES:
            raise ValueError(
                f"logprob dtype must be one of {list(LOGPROB_DTYPES)}, got {self.logprob_dtype!r}"
            )
        if not 0 <= self.samples <= 255:
            raise ValueError(f"samples must be in [0, 255] (uint8 counts), got {self.samples}")

    @property
    def id_bits(self) -> int:
        return id_bits(int(self.teacher["vocab_size"]))

    def to_json(self) -> dict:
        return {**asdict(self), "id_bits": self.id_bits}

    @staticmethod
    def from_json(d: dict) -> CacheMeta:
        known = {k: v for k, v in d.items() if k != "id_bits"}
        return CacheMeta(**known)

    def schema(self) -> pa.Schema:
        fields = [
            pa.field("shard_file", pa.string(), nullable=False),
            pa.field("row", pa.int32(), nullable=False),
            pa.field("topk_ids", pa.binary(), nullable=False),
            pa.field("topk_logprobs", pa.list_(LOGPROB_DTYPES[self.logprob_dtype][0]), False),
            pa.field("tail_logprob", pa.list_(pa.float32()), nullable=False),
        ]
        if self.target:
            fields.append(pa.field("target_logprob", pa.list_(pa.float32()), nullable=False))
        if self.samples:
            fields += [
                pa.field("sample_n", pa.list_(pa.uint8()), nullable=False),
                pa.field("sample_ids", pa.binary(), nullable=False),
                pa.field("sample_counts", pa.list_(pa.uint8()), nullable=False),
            ]
        return pa.schema(fields, metadata={META_KEY: json.dumps(self.to_json()).encode()})


def read_file_meta(schema: pa.Schema, *, where: str) -> CacheMeta:
    """The `CacheMeta` a cache file carries (ValueError if it is not a cache file)."""
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"{where}: not a teacher cache file (no {META_KEY.decode()} metadata)")
    return CacheMeta.from_json(json.loads(raw))
