"""Checkpoints: DCP for exact resume, with nothing in them that can run code, and the export.

The state is split into tensors (for DCP) and JSON (`state_split`), written and read by DCP
storage that unpickles nothing (`dcp_io`), locally or in an object store (`remote`), and
published, verified and exported by `checkpointer` (docs/integrity.md, "Checkpoints").
"""
