"""The teachers of a run: where they run, and how their outputs reach the student.

What a teacher computes is the library's (`tokenbridge.teacher`: `teacher_forward` and the
`TeacherOutputs` wire format); this package runs it next to a student rank (a worker process,
inline, or read from a cache) and carries its outputs through a shared slot ring
(docs/parallelism.md, "Teachers and their layouts").
"""
