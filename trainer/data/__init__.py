"""The trainer's data: the shard reader and its stream, microbatches, the shard batches as a
source for the step, and inputs fetched from an object store."""
