"""The trainer's inputs at object-store URLs: fetched once per node into a bounded local cache,
verified, then read from the local copy exactly as a local input (memory-mapped).

Before any model loads, `localize` replaces each URL in the config by its local copy; with
``data.stream=true`` the shards come one file at a time instead (docs/training.md, "Config
keys").
"""

from __future__ import annotations

import os

from tokenbridge import remote_models, urls
from tokenbridge.formats import streamed_shards
from tokenbridge.remote_cache import DEFAULT_DIR, RemoteCache

__all__ = ["DEFAULT_DIR", "localize"]


def localize(cfg) -> dict[str, tuple[str, str]]:
    """Replace every object-store URL among the run's inputs (``data.shards``,
    ``teachers[i].cache``, ``teachers[i].projection``, ``model.path``, ``teachers[i].path``) by
    its verified local copy, in `cfg` (a `TrainConfig`); returns {field: (URL, local copy)}.
    Every rank calls it (preflight)."""
    cache = RemoteCache(
        cfg.data.cache_dir or DEFAULT_DIR,
        limit_bytes=int(cfg.data.cache_limit_gb * 1e9),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    was: dict[str, tuple[str, str]] = {}
    if cfg.data.stream:  # a URL, no teacher cache (`rules.stream_reads_a_store`)
        url = cfg.data.shards
        cfg.data.shards = str(
            streamed_shards.prepare(url, cache.root, keep_files=cfg.data.stream_files)
        )
        was["data.shards"] = (url, f"{cfg.data.shards} (streamed)")
    elif urls.is_url(cfg.data.shards):
        url, cfg.data.shards = cfg.data.shards, str(cache.fetch_dir(cfg.data.shards))
        was["data.shards"] = (url, cfg.data.shards)
    for where, m in [
        ("model", cfg.model),
        *((f"teachers[{i}]", t) for i, t in enumerate(cfg.teachers)),
    ]:
        if urls.is_url(m.path):
            url, m.path = m.path, str(remote_models.fetch(cache, m.path))
            was[f"{where}.path"] = (url, m.path)
    for i, t in enumerate(cfg.teachers):
        if urls.is_url(t.cache):
            url, t.cache = t.cache, str(cache.fetch_dir(t.cache))
            was[f"teachers[{i}].cache"] = (url, t.cache)
        if urls.is_url(t.projection):
            url, t.projection = t.projection, str(cache.fetch_file(t.projection))
            was[f"teachers[{i}].projection"] = (url, t.projection)
    return was
