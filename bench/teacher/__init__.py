"""The offline teacher cache (`cache`): bytes per token, build throughput, steps from it."""
