"""The student's sampler: batched, KV-cached decoding with per-rollout seeds (`sampler`), its
decode step (`decode`), the int8 copy it may sample from (`int8`), and the measured form of each
decode product (`orient`)."""
