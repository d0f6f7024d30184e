"""The trainer's step and its parts: losses, logits, memory, vocab-parallel ops, TP and CP, the
teacher's logit channel, checksums, the sharded load, `make demo` end to end and the evals.
"""
