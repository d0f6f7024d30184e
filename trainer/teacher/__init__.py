"""The teachers of a run: where they run, and how their outputs reach the student.

What a teacher computes is the library's (`tokenbridge.teacher`: `teacher_forward` and the
`TeacherOutputs` wire format); this package runs it next to a student rank.

- `ring`: the slot ring (tensor specs, slot layout, shared-memory arena, errors): memory shared
  by a student rank and its teacher, allocated once;
- `worker`: the teacher worker process and the student's handle on it (imports the ring);
- `channel`: `TeacherChannel`, submit / receive / close over the ring, with the teacher behind
  one of two backends of the same interface: the worker process, or an inline call;
- `model_program`: `TeacherModelProgram`, the program a worker runs for off- and on-policy
  teachers alike: the model built (TP over the teachers' group), then `teacher_forward`;
- `cached_teacher`: `CachedTeacher`, a teacher read from an offline cache (`make
  teacher-cache`), and the preflight's checks of that cache;
- `dispatch`: `Feed` (microbatches to the teachers, one step ahead), `open_teachers` (per KD
  term a `LiveTeacher` over a channel, or a `CachedTeacher`).

Imports go one way: ring <- worker <- channel <- dispatch, cached_teacher <- dispatch, and
model_program <- (ring, worker).
"""
