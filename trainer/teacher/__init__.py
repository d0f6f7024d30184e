"""The teachers: what they compute, where they run, and how their outputs reach the student.

- `ring`: the slot ring (tensor specs, slot layout, shared-memory arena, errors): memory shared
  by a student rank and its teacher, allocated once;
- `worker`: the teacher worker process and the student's handle on it (imports the ring);
- `channel`: `TeacherChannel`, submit / receive / close over the ring, with the teacher behind
  one of two backends of the same interface: the worker process, or an inline call;
- `feed`: `Feed` (microbatches to the channels, one step ahead), `open_teachers`;
- `program`: `TeacherModelProgram`, the one teacher compute path (trainer, tests, benchmarks).

Imports go one way: ring <- worker <- channel <- feed, and program <- (ring, worker).
"""
