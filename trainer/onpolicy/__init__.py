"""On-policy distillation: the student samples, every teacher scores what it wrote.

Read in this order (docs/onpolicy.md has the whole picture):

- `prompts`: where prompts come from (prefixes of raw-text shard windows, or conversations
  rendered with the student's template and its generation prompt), resumable;
- `sampler`: the student's batched, KV-cached, seeded sampler and the FSDP2 gather for a
  rollout phase;
- `realign`: a rollout's bytes rendered for a teacher with another tokenizer and aligned on the
  fly with the align job's own aligner (completion chunks only);
- `rollouts`: rollouts -> microbatches for the student, each teacher and each loss;
- `rollout_scoring`: the teachers' channels, running the off-policy teachers' own program (the
  student's top-k ids travel with the rows);
- `teachers`: the run's on-policy terms, views and preflight checks;
- `agreement`: the teachers' bits per byte of the student's own completions;
- `side`: `OnPolicy`, the on-policy side of a run (sampling, scoring, policy lag, its
  checkpointed state, GKD's lambda draw), built by `open_onpolicy`;
- `rollout_source`: `RolloutSource`, a step's rollouts handed to the one training step
  (`trainer.step`) as its microbatches.

The losses live with the others (`tokenbridge.losses.opd`: `opd_topk`, `opd_pg`, the
probability-space mixture); the loss-mode registry holds their records.
"""
