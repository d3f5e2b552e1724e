"""Parquet input (``data.format: parquet``): the feature schema, the files, and row groups streamed
into the cache's NumPy days (docs/own-data.md)."""
