"""The teachers: what they compute, where they run, and how their outputs reach the student.

- `ring`: the slot ring (tensor specs, slot layout, shared-memory arena, errors): memory shared
  by a student rank and its teacher, allocated once;
- `worker`: the teacher worker process and the student's handle on it (imports the ring);
- `channel`: `TeacherChannel`, submit / receive / close over the ring, with the teacher behind
  one of two backends of the same interface: the worker process, or an inline call;
- `cache`: `CachedTeacher`, a teacher read from an offline cache (`make teacher-cache`), and
  the preflight's checks of that cache;
- `feed`: `Feed` (microbatches to the teachers, one step ahead), `open_teachers` (per KD term a
  `LiveTeacher` over a channel, or a `CachedTeacher`);
- `program`: `TeacherModelProgram`, the one teacher compute path (trainer, tests, benchmarks,
  and the teacher-cache job's RunInference handler).

Imports go one way: ring <- worker <- channel <- feed, cache <- feed, and program <- (ring,
worker).
"""
