"""The files tokenbridge writes and reads, each defined in one module.

- `schema`: the record schema of aligned shards (the contract between the align job and the
  trainer), tokenizer info and chunk kinds;
- `shards`: shard directories, written atomically and read back only when complete;
- `checksums`: the checksums of every file a writer writes and the COMPLETED markers;
- `value_checks`: values checked before they reach a model (ids < vocab, chunk columns);
- `teacher_cache`, `teacher_cache_reader`, `fingerprints`: the offline teacher cache's files,
  how the trainer opens them, and what they are checked against.
"""
