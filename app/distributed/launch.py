"""Checks on how the processes were launched, and the NCCL/RCCL error-handling defaults.

When torchrun, SLURM or MPI creates the processes, Lightning trusts ``trainer.devices`` x
``trainer.num_nodes`` as the world size and never compares it with the number of processes actually
started (its check runs only in its own launcher): a mismatch would wait at the rendezvous for ranks
that do not exist. This module compares them before anything starts.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment, SLURMEnvironment

# Error handling of NCCL (RCCL on ROCm), set only where the user has not chosen: a collective that
# exceeds trainer.strategy.init_args.timeout_s aborts the communicator and ends the process (3 =
# tear down without cleanup, the default of torch >= 2.2, stated for older builds), and a dump of
# what each rank was doing is written for the post-mortem.
NCCL_ERROR_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}


def set_collective_error_defaults() -> None:
    """Exports NCCL_ERROR_DEFAULTS for the variables the environment does not already set."""
    for name, value in NCCL_ERROR_DEFAULTS.items():
        os.environ.setdefault(name, value)


def check_launch(environment: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    """Raises ValueError when an external launcher started another number of processes than
    ``devices`` x ``num_nodes``, or when srun started several tasks that Lightning does not see as SLURM's."""
    check_slurm_detected(environment)
    # Lightning's own launcher (and its children) start exactly devices x num_nodes by construction.
    if not environment.creates_processes_externally or isinstance(environment, LightningEnvironment):
        return
    launcher = "SLURM (srun)" if isinstance(environment, SLURMEnvironment) else type(environment).__name__
    expected = devices * num_nodes
    launched = environment.world_size()
    if launched != expected:
        raise ValueError(
            f"{launcher} started {launched} processes, but trainer.devices x trainer.num_nodes = {devices} x "
            f"{num_nodes} = {expected}: launch {expected} processes ({devices} per node, e.g. srun "
            f"--ntasks-per-node={devices} / torchrun --nproc_per_node {devices}) or change the config"
        )
    environment.validate_settings(num_devices=devices, num_nodes=num_nodes)


def check_slurm_detected(environment: ClusterEnvironment) -> None:
    """Raises ValueError for srun tasks of a job named ``bash`` or ``interactive``: Lightning turns its SLURM
    detection off for those names (so that another launcher can run inside an interactive allocation),
    and every task would then start a launcher of its own, each with its own world of processes."""
    step_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or os.environ.get("SLURM_NTASKS") or 1)
    launched_by_srun = "SLURM_PROCID" in os.environ and step_tasks > 1
    job_name = SLURMEnvironment.job_name()
    if launched_by_srun and job_name in ("bash", "interactive") and not isinstance(environment, SLURMEnvironment):
        raise ValueError(
            f"srun started {step_tasks} tasks of a job named {job_name!r}, a name for which Lightning does not "
            "detect SLURM: each task would start its own processes. Give the job another name (sbatch/srun "
            "--job-name=dlrm), or run one task that launches the rest (srun --ntasks=1 ... or torchrun)"
        )
