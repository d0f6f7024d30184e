"""The projection job (``make projection``): see `pipelines.projection.__main__`."""
