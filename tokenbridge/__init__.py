"""tokenbridge, the library: everything a distillation across tokenizers stands on.

The ground floor of three (README, "Layout"): `pipelines/` (the Apache Beam jobs) and
`trainer/` (the torchrun runner) both import this package, and it imports neither of them,
nor Apache Beam, nor Hydra, and it launches no process. A user with a training loop of their
own needs nothing else:

- `tokenbridge.tokenizers`: one adapter over HF / GGUF / SentencePiece / tiktoken tokenizers;
- `tokenbridge.alignment`: two tokenizations of one text -> chunks, windows cut at chunk ends;
- `tokenbridge.chat`: conversations rendered by each model's template, train flags;
- `tokenbridge.projection`: the sparse vocabulary projection (builder and file);
- `tokenbridge.formats`: shard, teacher-cache and checksum files, and their readers;
- `tokenbridge.teacher`: `teacher_forward` and `TeacherOutputs`, what a teacher hands a loss;
- `tokenbridge.losses` (+ `tokenbridge.dist_ops`): the losses, pure functions returning a sum
  and a count, with the vocab- and context-parallel ops they run on;
- `tokenbridge.models` (+ `model_spec`): HF causal LMs from local directories, load and export;
- tools on this floor: `tokenbridge.assets` (``make models``), `tokenbridge.commands.verify` (``make
  verify``), `tokenbridge.commands.pair_report`, and `tokenbridge.cli` (how every command fails: one line).
"""
