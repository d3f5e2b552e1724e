"""Tests of app/checkpoint: the format, resume, resharding, export, the run lock and pre-emption."""
