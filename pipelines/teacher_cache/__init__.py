"""The teacher-cache job: score aligned shards once, train many times without the teacher.

The handler runs the library's one teacher forward, so a cached output is the live teacher's;
the cache's files, fingerprints and reader are the library's (`tokenbridge.formats`).
"""
