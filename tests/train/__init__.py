"""Tests of app/train: the Lightning module, pipelines, optimizers, schedules, metrics, precision and early stopping."""
