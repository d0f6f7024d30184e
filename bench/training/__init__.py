"""The trainer's step and its parts: the whole step (`trainer_step`), losses, logits, memory,
vocab-parallel ops (`dist_ops`), TP and CP (`parallel`), the teacher's logit channel
(`logit_channel`), checksums (`integrity`), `make demo` end to end (`demo`) and the evals
(`eval`)."""
