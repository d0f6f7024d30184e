"""Object storage: the align job and the trainer on ``s3://`` against local files
(`object_store`), on a loopback SeaweedFS server (`seaweed`, which the tests use too)."""
