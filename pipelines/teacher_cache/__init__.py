"""The teacher-cache job: score aligned shards once, train many times without the teacher.

- `handler`: the RunInference model handler: the frozen teacher and the library's one teacher
  forward (`tokenbridge.teacher.forward.teacher_forward`), so a cached output is the live
  teacher's by construction;
- `score_dofns`, `job`: the Beam job (``python -m pipelines.teacher_cache`` / ``make
  teacher-cache``).

The cache's files (schema, codecs, `CacheMeta`), the fingerprints it is checked against and the
reader the trainer opens it with are the library's: `tokenbridge.formats.teacher_cache`,
`fingerprints` and `teacher_cache_reader`.
"""
