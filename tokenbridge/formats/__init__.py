"""The files tokenbridge writes and reads, each defined in one module.

The shard schema is the one contract between the align job and the trainer; every writer's files
get a checksum and a completion marker, and every reader checks both, and the values, before a
model sees them (docs/integrity.md).
"""
