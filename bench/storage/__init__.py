"""Object storage: the align job and the trainer on ``s3://`` against local files, and the
loopback SeaweedFS server the tests use too.
"""
