"""Tests of app/data: the raw TSV reader, the NumPy cache and day sources, batches, loaders and splits."""
