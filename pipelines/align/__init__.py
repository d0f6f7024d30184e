"""The align job: raw text or conversations -> aligned Arrow shards (``make align``).

`job` assembles the pipeline from the DoFns beside it; its stages: docs/pipelines.md.
"""
