"""On-policy distillation: the `make bench` section and its parts, and `make demo-onpolicy-compare`."""
