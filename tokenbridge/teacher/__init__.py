"""What a teacher computes for a loss, wherever it runs (a worker, the cache job, a rollout).

`teacher_forward` (`forward`) is the one teacher forward, and `TeacherOutputs` (`outputs`) the
one record every teacher source hands the loss: only what the loss reads, never whole logits.
"""
