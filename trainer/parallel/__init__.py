"""Parallelism for the trainer: the device mesh, the verbs that apply it to a model, and the
local process launcher of the tests and benchmarks.

- `mesh`: `ParallelGroups` and `build_mesh`, the (dp_shard, cp, tp) device mesh of a run;
- `parallelize`: process-group start-up and the verbs applied in order (`apply_tp`,
  `apply_cp`, `apply_fsdp`), plus clipping over the mesh;
- `cp_attention`: model-level context parallelism (an attention function for transformers);
- `spawn`: N local processes with a real process group (tests, benchmarks).

The distributed loss ops themselves live in the library (`tokenbridge.dist_ops`).
"""
