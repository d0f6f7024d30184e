"""On-policy distillation: the student samples, every teacher scores what it wrote, and the one
training step learns on it.

`side.OnPolicy` is the entry; docs/onpolicy.md follows a step through the modules. The losses
live with the others (`tokenbridge.losses.opd`).
"""
