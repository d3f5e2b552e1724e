"""Project-wide checks: docs, architecture, pinned requirements, the SLURM script and the multi-process test harness."""
