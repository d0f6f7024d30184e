"""The offline teacher cache: bytes per token, build throughput, steps from it."""
