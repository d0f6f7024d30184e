"""The Beam plumbing every job shares (the align and teacher-cache jobs import it, never each
other):

- `tagged`: tagged outputs (``MAIN`` / ``DEAD``) and `split`, dead letters counted by reason,
  stage timers, the metrics namespace;
- `writers`: the rolling-parts DoFn, the dead-letter writer, the one summary element;
- `rolling`: rolling part files, the output directory's preparation and the finalize step that
  publishes parts (COMPLETED last);
- `progress`: progress written by workers and printed by the launcher;
- `jobs`: the output side of a job's config, the default runner and output directory, the run
  checked to its COMPLETED marker, the summary line;
- `beam_worker`: Beam's local worker processes, started without their start-up chatter.
"""
