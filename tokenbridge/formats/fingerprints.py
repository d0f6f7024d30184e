"""The fingerprints a teacher cache is checked against: the teacher's weights and the shards.

Both are computed from files, without loading a model, so the trainer's preflight can refuse a
cache made for another teacher or other shards with no teacher weights in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from importlib import metadata
from pathlib import Path

from tokenbridge import atomic

DIGEST = 16  # bytes (32 hex digits), as the shard checksums


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _memo_path() -> Path:
    env = os.environ.get("TOKENBRIDGE_HASH_MEMO")
    return Path(env) if env else Path.home() / ".cache" / "tokenbridge" / "weight-hashes.json"


def _read_memo() -> dict:
    try:
        return json.loads(_memo_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_memo(memo: dict) -> None:
    path = _memo_path()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
        atomic.write(path, json.dumps(memo, sort_keys=True), fsync=False, tmp=tmp)


def file_hash(path: Path, *, memo: dict | None = None) -> str:
    """blake2b of a file's bytes, looked up in / added to `memo` by (path, size, mtime, inode)."""
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    if memo is not None and key in memo:
        return memo[key]
    h = hashlib.blake2b(digest_size=DIGEST)
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    digest = h.hexdigest()
    if memo is not None:
        memo[key] = digest
    return digest


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no weight files (*.safetensors, *.bin) to hash")
    return files


def weights_fingerprint(
    model_dir: str | os.PathLike,
    *,
    init: str = "pretrained",
    seed: int = 0,
    overrides: dict | None = None,
) -> str:
    """The fingerprint of a teacher's weights.

    Pretrained: blake2b of its weight files' bytes (``*.safetensors``, else ``*.bin``, by name).
    Random-init (tests, the debug config): blake2b of what determines its weights: config.json,
    the overrides, the seed, and the torch and transformers versions (the init draws from their
    RNG code). A weight file's hash takes seconds for a 1 GB teacher, so it is remembered per
    file (path, size, mtime, inode) in ``~/.cache/tokenbridge/weight-hashes.json``
    (``TOKENBRIDGE_HASH_MEMO`` moves it; best effort: a memo that cannot be read or written only
    costs the hash again); a file rewritten in place changes its mtime and is hashed anew.
    """
    d = Path(model_dir)
    if init == "random":
        config = (d / "config.json").read_bytes()
        desc = {
            "init": "random",
            "config": hashlib.blake2b(config, digest_size=DIGEST).hexdigest(),
            "overrides": dict(overrides or {}),
            "seed": int(seed),
            "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers"),
        }
        return "random:" + hashlib.blake2b(_canonical(desc), digest_size=DIGEST).hexdigest()
    memo = _read_memo()
    before = dict(memo)
    parts = {p.name: file_hash(p, memo=memo) for p in weight_files(d)}
    if memo != before:
        _write_memo(memo)
    return "blake2b:" + hashlib.blake2b(_canonical(parts), digest_size=DIGEST).hexdigest()


def shards_fingerprint(shard_set) -> str:
    """The fingerprint of a `tokenbridge.formats.shards.ShardSet`'s index (files, rows, checksums).

    The checksums are those COMPLETED lists: every shard file's from marker v2 on, stats.json's
    always."""
    index = {
        "files": {p.name: int(n) for p, n in zip(shard_set.files, shard_set.file_rows)},
        "checksums": shard_set.checksums,
    }
    return hashlib.blake2b(_canonical(index), digest_size=DIGEST).hexdigest()
