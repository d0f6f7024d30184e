"""Parallelism for the trainer: the device mesh, the verbs that apply it to a model, the sharded
build, and the local process launcher of the tests and benchmarks.

The distributed loss ops live in the library (`tokenbridge.dist_ops`); how the layouts fit
together: docs/parallelism.md.
"""
