"""Checkpoints: the on-disk format, loading under another plan, exporting, and saving on a signal.

``format`` (a sharded checkpoint folder: writing, atomic publishing, checking, reading),
``plan_json`` (a TorchRec ``ShardingPlan`` as JSON, as checkpoints and the plan report store it),
``reshard`` (reading saved shards into another world size or plan), ``export`` (one unsharded
model file and loading it into any sharding), ``preemption`` (``SaveOnSignal``: every rank saves on
SIGTERM/SIGUSR1, then stops), ``run_lock`` (one ``fit`` job per run folder).
"""
