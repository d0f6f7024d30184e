"""tokenbridge, the library: everything a distillation across tokenizers stands on.

The ground floor of three (docs/design.md): `pipelines/` (the Beam jobs) and `trainer/` (the
torchrun runner) import it; it imports neither, nor Apache Beam, nor Hydra, and launches no
process. A user with a training loop of their own needs nothing else (README, "The library in
your own loop").
"""
