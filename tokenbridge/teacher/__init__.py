"""What a teacher computes for a loss, wherever it runs (a worker, the cache job, a rollout).

- `outputs`: `TeacherOutputSpec` (what a loss asks for) and `TeacherOutputs` (the wire format
  every teacher source emits: top-k + tail, columns, the realised token's log-prob);
- `forward`: `teacher_forward`, the one teacher forward: a loaded model -> those outputs, the
  lm_head applied a chunk of positions at a time.
"""
