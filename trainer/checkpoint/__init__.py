"""Checkpoints: DCP for exact resume, with nothing in them that can run code, and the export.

- `checkpointer`: `Checkpointer` (save / load per step, COMPLETED with every file's checksum),
  `find_resume` (the newest good checkpoint, a damaged one moved aside), the student's export
  as a plain HF directory;
- `state_split`: a run's state split into tensors (for DCP) and one JSON document per rank;
- `dcp_io`: DCP's index written as JSON and read back by a reader and planner that unpickle
  nothing (tensor records through torch's weights-only loader).
"""
