"""The offline teacher cache: score aligned shards once, train many times without the teacher.

- `format`: the cache's Arrow schema, the id packing and log-prob codecs, `CacheMeta` (what a
  cache promises: teacher, shards, k, temperature, dtypes) — pure, read by the trainer;
- `fingerprints`: the fingerprints a cache is checked against (teacher weights, shards) — pure;
- `reader`: `open_cache` (marker, fingerprints, the row-for-row join with the shards) — pure;
- `handler`: the RunInference model handler (the trainer's teacher compute path);
- `dofns`, `job`: the Beam job (``python -m pipelines.teacher_cache`` / ``make teacher-cache``).

Only `handler` imports from `trainer/` (`trainer.teacher.model_program`, the one teacher compute
path), and nothing in `trainer/` imports `handler`, `dofns` or `job` (they import apache_beam).
"""
