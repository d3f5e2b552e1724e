"""A Lightning strategy that shards embedding tables with TorchRec's planner and DistributedModelParallel.

Why not DDPStrategy: DMP already wraps the dense part in DDP and leaves the sharded tables out of
it; an outer DDP would all-reduce dense gradients of whole tables. Why not ModelParallelStrategy:
its checkpoint loader accepts DTensor parameters only, while DMP's tables are ShardedTensors.

Life cycle inside ``Trainer.fit``:
    ``_configure_launcher`` (main process: settings are validated before any worker starts)
    -> ``setup_environment`` (process group: gloo on CPU, nccl on GPUs, which is RCCL on ROCm; for
       ``fit``, rank 0 takes the run folder's lock, app/checkpoint/run_lock.py)
    -> ``setup`` (plan on rank 0 and broadcast, wrap in DMP, combine the fused sparse optimizer with
       the dense one) -> training, where checkpoints are written by every rank through
       ``torch.distributed.checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.optim import Optimizer
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.keyed import KeyedOptimizer

from app.checkpoint import format as checkpoint_format
from app.checkpoint.export import is_exported_model, load_exported_into
from app.checkpoint.format import CheckpointInfo
from app.checkpoint.reshard import plan_allows
from app.checkpoint.run_folder import check_every_rank_has
from app.checkpoint.run_lock import RunFolderLock, run_folders
from app.distributed.job_lifetime import follow_launcher
from app.distributed.launch import JobLauncher, check_launch, set_collective_error_defaults
from app.distributed.placements import plan_on_devices
from app.distributed.plan_report import plan_report, report_holds_plan, write_plan_report
from app.distributed.rendezvous import join_process_group, long_wait_group, wait_for_every_rank
from app.train.lr_schedule import move_scheduler
from app.train.optimizers import StepOnceCombinedOptimizer
from app.train.pipeline import StepCallsModel
from app.train.precision import check_precision_supported
from app.distributed.sharding import (
    PLANNER_OBJECTIVES,
    PlannedSharding,
    TableConstraint,
    as_table_constraints,
    build_constraints,
    embedding_table_names,
    format_plan,
    host_memory_warning,
    plan_sharding,
    validate_fused_optimizer,
    validate_sharding_request,
)
from app.distributed.qcomms import QCommsSettings, check_qcomms, sharders_with_qcomms
from app.distributed.threads import set_worker_threads
from app.distributed.topology import DeviceTopology, resolve_topology, validate_topology_settings

# Precisions this strategy applies: float32, and bf16 autocast around each step (train_step_context).
APPLIED_PRECISIONS = ("32-true", "bf16-mixed")
# What the ranks wait for at the barriers that can take long, by the name the caller gives (messages).
BARRIER_WORK = {
    "cache_conversion": "the raw-TSV cache being converted, app.data.cache",
    "remove_checkpoint": "rank 0 deleting an old checkpoint",
}
# How long a rank whose collective failed waits for a rank of its node to end, to name it first: a killed
# rank closes its connections a moment before its end is known (an error of this rank's own costs it once).
_RANK_END_WAIT_S = 2.0


class TorchRecStrategy(ParallelStrategy):
    """Shards the embedding tables of the LightningModule across all processes with TorchRec.

    Args:
        sharding_types: sharding types the planner may use for every table (default: all the device
            supports: data_parallel, table_wise, column_wise, table_column_wise on CPU; also row_wise,
            table_row_wise and grid_shard on GPUs).
        table_constraints: per-table limits, keyed by table name (``t_cat_0`` ... ``t_cat_25``).
        topology: the hardware the planner plans for: ``auto`` (from the device's name, with the HBM free
            on the device when planning, the least over ranks), ``mi300x``, ``mi325x``, ``mi355x``,
            ``a100``, ``h100``, ``h200``, ``b200`` or ``cpu``. World size and devices per node always come from the launch.
        topology_overrides: figures that replace the preset's, by field: ``hbm_cap_bytes``,
            ``hbm_bw_gb_per_s``, ``ddr_cap_bytes``, ``ddr_bw_gb_per_s``, ``hbm_to_ddr_bw_gb_per_s``,
            ``intra_node_bw_gb_per_s``, ``inter_node_bw_gb_per_s``, ``bwd_compute_multiplier``; and what
            the planner leaves free for all but the tables: ``hbm_reserved_fraction`` (default 0.15: the
            dense part's activations, NCCL and all-to-all buffers, fragmentation) and
            ``hbm_reserved_bytes`` (default 0: a known extra per GPU). The dense part in training (6x its
            parameters, TorchRec's heuristic) and the pipeline's sparse inputs are reserved besides; the
            figures are in the log and in ``sharding_plan.txt``.
        planner_objective: ``performance`` (the plan with the lowest estimated step time) or ``memory``
            (the lowest peak HBM per device). On GPUs either may put tables in host memory through
            UVM kernels (``memory`` readily: it uses the least HBM); the run warns naming them.
        process_group_backend: ``gloo`` or ``nccl`` (default: ``nccl`` on GPUs, ``gloo`` on CPU).
        timeout_s: seconds a collective may wait before the process group gives up, so that a dead or
            stuck rank ends the job instead of hanging it. It must exceed the longest time one rank
            works alone while the others wait in a collective (planning, a slow first batch); the
            waits at barriers (around checkpoints) have their own ``barrier_timeout_s``.
        barrier_timeout_s: seconds a rank waits at a barrier for the others (on a gloo group of its own,
            not under the NCCL watchdog): the raw-TSV cache being converted at start-up (also the
            longest a converting rank waits for another node converting the same cache folder), rank 0
            publishing a checkpoint and deleting the previous one, ranks writing shards of uneven size.
            A rank that dies ends the wait at once; one that is stuck, after this, with a message
            naming the barrier and this setting.
        rendezvous_timeout_s: seconds every started rank waits for all ranks to join at start-up; a
            node that never starts or a wrong ``MASTER_ADDR`` ends the job after this, with a message
            naming the missing ranks.
        num_threads_per_process: torch intra-op threads of each process (default: ``OMP_NUM_THREADS``
            if set, else the machine's cores divided by the processes on the node; see app/distributed/threads.py).
        qcomms: compressed communication: the precision of the pooled embeddings sent forward by the
            all-to-all and of their gradients sent back, e.g. ``{forward_precision: fp16,
            backward_precision: fp16}`` (TorchRec's QCommsConfig; fp16 on CPU, also bf16 and fp8 forward on
            GPUs; app/distributed/qcomms.py). Default: none (fp32).
    """

    strategy_name = "torchrec"

    def __init__(
        self,
        sharding_types: list[str] | None = None,
        table_constraints: dict[str, TableConstraint] | None = None,
        topology: str = "auto",
        topology_overrides: dict[str, float] | None = None,
        planner_objective: str = "performance",
        process_group_backend: str | None = None,
        timeout_s: float = 300.0,
        barrier_timeout_s: float = 3600.0,
        rendezvous_timeout_s: float = 120.0,
        num_threads_per_process: int | None = None,
        qcomms: QCommsSettings | None = None,
    ) -> None:
        # Accelerator, devices and cluster environment are filled in by the Trainer.
        super().__init__()
        self.sharding_types = sharding_types
        self.table_constraints = as_table_constraints(table_constraints)  # as qcomms below: a plain dict from Python
        self.topology = topology
        self.topology_overrides = dict(topology_overrides or {})
        self.planner_objective = planner_objective
        self._process_group_backend = process_group_backend
        self.timeout_s = timeout_s
        if not barrier_timeout_s > 0:
            raise ValueError(f"trainer.strategy.init_args.barrier_timeout_s = {barrier_timeout_s}: must be > 0 seconds")
        self.barrier_timeout_s = barrier_timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.num_threads_per_process = num_threads_per_process
        # A dict from code that builds the strategy directly (the bench's variants), as the CLI's dataclass.
        self.qcomms = QCommsSettings(**qcomms) if isinstance(qcomms, dict) else qcomms
        # As launched: Lightning's launcher exports its own value later, in the launching process only.
        self._launch_omp_num_threads = os.environ.get("OMP_NUM_THREADS")
        self.num_nodes = 1
        self.sharding_plan: ShardingPlan | None = None
        # The ckpt_path the run was given ("last", "best" or a path), set by the CLI: Lightning names the
        # checkpoint to the strategy only after setup, but the plan must be chosen before (see _shard).
        self.requested_ckpt_path: str | None = None
        self._dmp: DistributedModelParallel | None = None
        # (path, metadata) of the checkpoint being loaded: read once, for the plan and for the load.
        self._checkpoint_read: tuple[str, CheckpointInfo] | None = None
        self._run_lock: RunFolderLock | None = None  # held by global rank 0 while fitting
        # Record each checkpoint's shard checksums (always, in a run; the checkpoint bench turns it off on
        # alternate saves to measure what it costs: app/bench/checkpoint_save.py).
        self.checkpoint_checksums = True
        # Whether the connected module declares a pipelined step (StepCallsModel), asked once in `connect`:
        # a runtime-checkable Protocol's isinstance walks its members (tens of microseconds a training step).
        self._module_may_call_model = False

    # ---- processes -------------------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        return "gloo" if self.root_device.type == "cpu" else "nccl"

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Sharded state can only be loaded into a model that is already sharded.
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers together with the model

    def _configure_launcher(self) -> None:
        follow_launcher()  # a rank the launcher below started (if python -m app has not already)
        # Runs in the launching process, before workers exist: the cheapest place to fail.
        self._validate_settings()
        assert self.cluster_environment is not None
        check_launch(self.cluster_environment, self.num_processes, self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = JobLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _validate_settings(self) -> None:
        if self.parallel_devices:
            validate_sharding_request(self.sharding_types, self.table_constraints, self.parallel_devices[0].type)
        validate_topology_settings(self.topology, self.topology_overrides)
        if self.parallel_devices and self.topology != "auto":  # auto reads the device: left to each rank
            resolve_topology(self.topology, self.topology_overrides, self.parallel_devices[0])
        if self.planner_objective not in PLANNER_OBJECTIVES:
            raise ValueError(
                f"strategy.planner_objective = {self.planner_objective!r}: choose one of {', '.join(PLANNER_OBJECTIVES)}"
            )
        if self.parallel_devices:
            check_qcomms(self.qcomms, self.parallel_devices[0].type)
        if self._process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(f"strategy.process_group_backend = {self._process_group_backend!r}: use gloo or nccl")
        for name in ("timeout_s", "rendezvous_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"trainer.strategy.init_args.{name} = {getattr(self, name)}: must be > 0 seconds")

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        # TorchRec tells intra- from inter-node links by LOCAL_WORLD_SIZE (default 8); Lightning's
        # launcher and SLURM do not export it.
        os.environ["LOCAL_WORLD_SIZE"] = str(self.num_processes)
        rank_zero_info(set_worker_threads(self.num_processes, self.num_threads_per_process, self._launch_omp_num_threads))
        set_collective_error_defaults()
        assert self.cluster_environment is not None
        join_process_group(
            self.process_group_backend,
            address=self.cluster_environment.main_address,
            port=self.cluster_environment.main_port,
            rank=self.global_rank,
            world_size=self.world_size,
            processes_per_node=self.num_processes,
            rendezvous_timeout_s=self.rendezvous_timeout_s,
            timeout_s=self.timeout_s,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
        )
        self._hold_run_folder()

    def _hold_run_folder(self) -> None:
        """``fit`` owns its run folder: global rank 0 takes its lock before any work starts, and every
        rank learns the outcome, so that a refused job stops on all ranks with the same line."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or self._run_lock is not None:
            return
        check_every_rank_has(run_folders(trainer))  # each rank chose it while parsing (app/checkpoint/run_folder.py)
        refusal = self._take_run_folder(trainer) if self.is_global_zero else None
        refusal = self.broadcast(refusal)
        if refusal is not None:
            raise ValueError(refusal)

    def _take_run_folder(self, trainer: Trainer) -> str | None:
        """Rank 0's half of :meth:`_hold_run_folder`: the refusal as a line, never raised before the others hear it."""
        folders = run_folders(trainer)
        lock = RunFolderLock(folders)
        try:
            refusal = lock.acquire()
        except OSError as error:
            return f"cannot write the lock file of run folder {folders[0]} ({error}): set a writable trainer.default_root_dir"
        if refusal is None:
            self._run_lock = lock
            for line in lock.taken_over():
                rank_zero_info(line)
        return refusal

    # ---- model and optimizers --------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._reject_settings_fused_updates_cannot_honour(trainer)
        self.model = self._shard(self.lightning_module, self._checkpoint_to_load(trainer))
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def check_before_launch(self, trainer: Trainer, module: LightningModule) -> None:
        """The set-up checks that need no process group, for the CLI to run before any worker starts, so
        that a refused setting costs no launch; ``setup`` runs them again for every other caller."""
        self._reject_settings_fused_updates_cannot_honour(trainer)
        validate_fused_optimizer(module, self.root_device.type)

    def _reject_settings_fused_updates_cannot_honour(self, trainer: Trainer) -> None:
        # The sparse optimizer updates the tables inside backward, so nothing can happen between
        # backward and step: no accumulation, no loss scaling of fp16.
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"trainer.accumulate_grad_batches = {trainer.accumulate_grad_batches}: the embedding optimizer is "
                "fused into backward and updates every step; raise data.batch_size instead"
            )
        precision = str(getattr(self.precision_plugin, "precision", ""))
        if precision.startswith("16"):
            raise ValueError(
                f"trainer.precision = {precision}: fp16 loss scaling cannot reach the fused embedding update; "
                "use bf16-mixed"
            )
        if precision not in APPLIED_PRECISIONS:
            # Lightning converts the module's weights (bf16-true, 64-true) or swaps its layers
            # (transformer-engine) in Strategy.connect/_setup_model paths this strategy does not take:
            # DMP owns the module, and FBGEMM's tables keep their own dtype. The run would train in
            # float32 while claiming another precision.
            raise ValueError(
                f"trainer.precision = {precision}: not applied to a TorchRec-sharded model (the app applies "
                f"{' and '.join(APPLIED_PRECISIONS)}); use bf16-mixed"
            )
        check_precision_supported(precision, str(getattr(self.precision_plugin, "device", "cpu")))  # MixedPrecision's device

    def _checkpoint_to_load(self, trainer: Trainer) -> str | None:
        if not self.requested_ckpt_path:
            return None
        # Lightning's own resolution of "last"/"best", so that the plan comes from the checkpoint that
        # Lightning then loads (the callbacks' folders are known by now).
        path = trainer._checkpoint_connector._parse_ckpt_path(
            trainer.state.fn, self.requested_ckpt_path, model_provided=True, model_connected=True
        )
        return None if path is None else str(path)

    def _shard(self, module: LightningModule, checkpoint_path: str | None) -> DistributedModelParallel:
        if self._dmp is not None and self._dmp.module is module:
            return self._dmp  # a second trainer.validate()/test() after fit: already sharded
        tables = embedding_table_names(module)
        validate_sharding_request(self.sharding_types, self.table_constraints, self.root_device.type, tables)
        validate_fused_optimizer(module, self.root_device.type)
        check_qcomms(self.qcomms, self.root_device.type)
        sharders = sharders_with_qcomms(self.qcomms, self.root_device)
        # A checkpoint's shards and optimizer keys fit the plan they were written under, and the
        # planner may choose differently between runs (ties between table- and column-wise): reuse it.
        # Otherwise (another world size, or a plan that breaks this run's sharding settings) plan afresh
        # and let the loader reshard (app/checkpoint/reshard.py). An exported model file has no plan.
        constraints = build_constraints(tables, self.sharding_types, self.table_constraints)
        allowed = {table: c.sharding_types for table, c in constraints.items()}
        exported = checkpoint_path is not None and is_exported_model(checkpoint_path)
        saved = self._checkpoint_info(checkpoint_path, module) if checkpoint_path and not exported else None
        reuse = (
            saved is not None
            and saved.world_size == self.world_size
            and plan_allows(saved.sharding_plan, allowed, self.world_size)
        )
        device_topology = resolve_topology(self.topology, self.topology_overrides, self.root_device)
        planned = PlannedSharding(saved.sharding_plan, []) if reuse else plan_sharding(
            module,
            device=device_topology,
            world_size=self.world_size,
            local_world_size=self.num_processes,
            sharders=sharders,
            constraints=constraints,
            batch_size_per_rank=getattr(module.trainer.datamodule, "batch_size", None),
            objective=self.planner_objective,
            process_group=dist.group.WORLD,
        )
        # The planner's placements name cuda:{rank % local_world_size} and a saved plan names the
        # devices of the run that wrote it; torch refuses a shard whose device differs from its placement.
        assert self.parallel_devices is not None
        planned.plan = plan_on_devices(planned.plan, self.parallel_devices)
        self.sharding_plan = planned.plan
        if reuse and (warning := host_memory_warning(planned)):  # plan_sharding warns for a fresh plan
            rank_zero_warn(warning)
        source = f", as saved in {checkpoint_path}" if reuse else ""
        rank_zero_info(f"TorchRec sharding plan ({self.world_size} ranks{source}):\n{format_plan(self.sharding_plan)}")
        self._write_plan_report(planned, device_topology, source=str(checkpoint_path) if reuse else "the planner")
        self._dmp = DistributedModelParallel(
            module,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=self.root_device,
            plan=self.sharding_plan,
            sharders=sharders,
        )
        return self._dmp

    def _write_plan_report(self, planned: PlannedSharding, device: DeviceTopology, source: str) -> None:
        # Written when fitting; validate/test/predict reuse a checkpoint's plan and leave the report be.
        trainer = self.lightning_module.trainer
        if not self.is_global_zero or trainer.state.fn != TrainerFn.FITTING:
            return
        folder = Path(trainer.default_root_dir)
        if not planned.estimates and report_holds_plan(folder, planned.plan):
            return  # a resumed run: the report of the run that made this plan has the planner's estimates
        report = plan_report(
            planned, device=device, world_size=self.world_size, local_world_size=self.num_processes,
            objective=self.planner_objective, source=source,
        )
        path = write_plan_report(report, folder)
        rank_zero_info(f"Sharding plan with the planner's estimates: {path} and {path.with_suffix('.txt')}")

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Steps one optimizer: the DMP's fused sparse optimizer combined with the module's dense one."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1 or not isinstance(self.optimizers[0], KeyedOptimizer):
            raise TypeError(
                "configure_optimizers must return exactly one torchrec KeyedOptimizer for the dense parameters "
                "(e.g. KeyedOptimizerWrapper); the strategy adds the fused embedding optimizer to it"
            )
        assert self._dmp is not None
        self.optimizers = [StepOnceCombinedOptimizer([("sparse", self._dmp.fused_optimizer), ("dense", self.optimizers[0])])]
        for config in self.lr_scheduler_configs:  # the schedule must reach the embedding update too
            config.scheduler = move_scheduler(config.scheduler, self.optimizers[0])

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if self._module_may_call_model and module.training_step_calls_model:
            # A pipelined step (app.train.pipeline) calls the DMP once per batch itself; routing the step
            # through the DMP as well would nest two forwards of the DDP around the dense part. It enters
            # the precision's context around its forward alone, not around the backward it also runs.
            return module.training_step(*args, **kwargs)
        return super().training_step(*args, **kwargs)

    def connect(self, model: LightningModule) -> None:
        super().connect(model)
        self._module_may_call_model = isinstance(model, StepCallsModel)

    def model_to_device(self) -> None:
        pass  # DMP places every shard and the dense part itself; a .to() would undo the sharding

    # ---- collectives -----------------------------------------------------------------------

    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        # The barriers are where ranks wait while one works alone (rank 0 publishing a checkpoint and
        # deleting the previous one, uneven shard writes): on gloo with barrier_timeout_s, since an NCCL
        # barrier would end a healthy job after timeout_s (app/distributed/rendezvous.py).
        try:
            wait_for_every_rank(self.barrier_timeout_s)
        except RuntimeError as error:
            # Gloo's words for a wait that ran out: "failed to pass monitoredBarrier" on rank 0, "Timed
            # out" on the others, the store's "wait timeout" when the group's creation (the first barrier)
            # waited; a rank that died closes its connection instead (not a timeout).
            if not any(words in str(error) for words in ("monitoredBarrier in", "Timed out", "wait timeout")):
                raise
            what = BARRIER_WORK.get(name or "", "one rank's work")
            raise ValueError(
                f"rank {dist.get_rank()}: waited trainer.strategy.init_args.barrier_timeout_s = "
                f"{self.barrier_timeout_s:g} s at the {name or 'strategy'} barrier ({what}) for a rank that did not "
                f"come: raise it if that work takes longer; {str(error).splitlines()[0]}"
            ) from None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def on_exception(self, exception: BaseException) -> None:
        # Gloo's error on a rank whose peer died says only "Connection reset by peer"; under Lightning's
        # launcher this process started the other ranks of its node and names one that a signal ends
        # (JobLauncher): that line comes first.
        if isinstance(self._launcher, JobLauncher) and isinstance(exception, RuntimeError):
            self._launcher.wait_for_a_rank_to_end(_RANK_END_WAIT_S)

    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        if self._run_lock is not None:
            self._run_lock.release()
            self._run_lock = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ---- checkpoints -----------------------------------------------------------------------
    # The format lives in app/checkpoint/format.py: every rank writes its own shards through
    # torch.distributed.checkpoint; rank 0 adds the plain-data metadata and publishes the folder.

    @property
    def checkpoint_process_group(self) -> dist.ProcessGroup | None:
        """The group DCP's collectives go through when saving and loading: the barriers' gloo group, so
        that ranks waiting for the slowest writer or reader wait up to ``barrier_timeout_s`` and not
        under the NCCL watchdog's ``timeout_s``. DCP exchanges only plans and results on it (pickled,
        on the host); every rank reads and writes its own shards itself. None without a process group."""
        return long_wait_group(self.barrier_timeout_s) if dist.is_initialized() else None

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return getattr(optimizer, "_optimizer", optimizer).state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TorchRecStrategy.save_checkpoint does not take storage_options")
        assert self.sharding_plan is not None
        checkpoint_format.save(
            checkpoint, filepath, self, self.sharding_plan, self.world_size, checksums=self.checkpoint_checksums
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only needs no switch here: nothing in a checkpoint is ever unpickled as code.
        if is_exported_model(checkpoint_path):
            if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                raise ValueError(
                    f"ckpt_path {checkpoint_path}: an exported model holds no training state; resume fit from a checkpoint folder"
                )
            return load_exported_into(checkpoint_path, self.lightning_module)
        info = self._checkpoint_info(checkpoint_path, self.lightning_module)
        optimizers = self.optimizers if "optimizer_states" in info.meta["tensor_keys"] else []
        checkpoint_format.load_sharded_state(
            info, self.lightning_module, optimizers, self.sharding_plan, process_group=self.checkpoint_process_group
        )
        self._checkpoint_read = None  # this load is done: a later one (the file rewritten since) reads afresh
        return info.meta

    def use_checkpoint_info(self, checkpoint_path: str, info: CheckpointInfo) -> None:
        """Takes a checkpoint's metadata read by every process before the launch (the CLI reads it to build
        the checkpoint's model), so that planning and loading do not read it again."""
        self._checkpoint_read = (str(checkpoint_path), info)

    def _checkpoint_info(self, checkpoint_path: Any, module: LightningModule) -> CheckpointInfo:
        """The checkpoint's metadata, read once per load and checked against ``module`` (every rank raises
        the same error): as handed over by :meth:`use_checkpoint_info`, else read by rank 0 and broadcast."""
        if self._checkpoint_read is not None and self._checkpoint_read[0] == str(checkpoint_path):
            info = self._checkpoint_read[1]
            checkpoint_format.check_fits_model(checkpoint_path, info.index, info.meta, module)  # the same on every rank
            return info
        result: CheckpointInfo | str
        if self.is_global_zero:
            try:
                result = checkpoint_format.read(checkpoint_path, module)
            except (ValueError, OSError) as error:  # as a message: the other ranks wait for one
                result = str(error)
        else:
            result = ""
        result = self.broadcast(result)
        if isinstance(result, str):
            raise ValueError(result)
        self._checkpoint_read = (str(checkpoint_path), result)
        return result

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint has loaded the shards already

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint has loaded the optimizer state already

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoint_format.remove(filepath)
        # ModelCheckpoint calls this on every rank with the same decision (it depends on paths only).
        # Without this barrier the others would wait for rank 0's delete (minutes for a large folder on
        # a network filesystem) inside their next NCCL collective, under timeout_s.
        self.barrier("remove_checkpoint")
