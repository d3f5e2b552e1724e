"""Notices the pinned libraries print on every run that no setting can change and that say nothing
about the run: silenced, each by its exact message (with its category and emitting module where it
has them) and the reason it is harmless, in every process of the app (``python -m app`` and the
ranks Lightning starts as ``python -m app`` again) and of the benchmark.

``tests/cli/test_warnings.py`` proves the fbgemm autograd notice harmless and checks that a real
2-process fit prints none of these.
"""

from __future__ import annotations

import logging
import warnings


def silence_library_notices() -> None:
    """Silence the notices below; safe to call more than once in a process."""
    # Deprecation notices from the libraries' own internals (DDP's arguments in TorchRec, pytree, fx).
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # Replicated (data_parallel) tables look up through fbgemm's DenseTableBatchedEmbeddingBagsCodegen,
    # whose op fbgemm::dense_embedding_codegen_lookup_function has a CPU (CUDA) kernel and no kernel at
    # the Autograd key, so torch's autograd fallback wraps it (autograd_not_implemented_fallback.cpp,
    # basicAutogradNotImplementedFallbackImpl). But that kernel builds its own graph: it returns
    # SplitLookupFunction_Dense_Op::apply(...), a torch::autograd::Function whose backward is
    # split_embedding_backward_codegen_dense_cpu (embedding_backward_dense_host_cpu.cpp). Its output
    # already requires grad, so the fallback only hooks a warning onto it; the gradient is fbgemm's.
    # Proof: tests/cli/test_warnings.py, test_dense_lookup_gradient_is_fbgemms_own_and_exact (the op's
    # gradient == nn.EmbeddingBag's, exactly) and test_replicated_tables_train_like_one_process
    # (2 ranks, every table data_parallel == 1 process, unsharded, under plain SGD).
    warnings.filterwarnings(
        "ignore",
        message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        category=UserWarning,
        module=r"torch\.autograd",
    )
    # The pipelined training step takes Lightning's dataloader_iter on purpose (app/train/pipeline.py);
    # Lightning 2.6.6 is pinned and tests/train/test_pipeline.py checks what the app relies on.
    warnings.filterwarnings(
        "ignore",
        message="Found `dataloader_iter` argument in the `training_step`",
        category=UserWarning,
        module=r"lightning\.pytorch\.loops\.utilities",
    )
    # DLRMModule.transfer_batch_to_device copies a CriteoBatch non_blocking from whatever data module
    # feeds it; Lightning says on every run that the module's hook is the one used, which is the intent.
    warnings.filterwarnings(
        "ignore",
        message="You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a `LightningDataModule`",
        category=UserWarning,
    )
    # Lightning's own all_gather (LightningModule.all_gather, used by RankHealth) still calls
    # torch.distributed.nn.functional.all_gather, deprecated but working (under no_grad there).
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated",
        category=FutureWarning,
        module=r"lightning\.fabric\.utilities\.distributed",
    )
    # TorchRec's sharded tables come in state dicts as ShardedTensor, which torch means to replace with
    # DTensor; every read of a sharded checkpoint (validate, test, predict, resume) touches them.
    warnings.filterwarnings(
        "ignore", message="Please use DTensor instead and we are deprecating ShardedTensor", category=FutureWarning
    )

    # Lightning's advertisement for its cloud loggers (logger_connector.py): printed on every run that
    # has no LitLogger, with no switch to turn it off (Lightning-AI/pytorch-lightning#21294).
    _drop_log_records("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud")
    # The planner gives a data_parallel table no sharding spec by design (a full replica on every rank,
    # torchrec planner/planners.py to_sharding_plan), then warns once per such table that it has none
    # (validate_rank_assignment, through the root logger); the plan the app prints shows them "replicated".
    _drop_log_records("", "Sharding spec not found for ")  # "": the root logger
    # Logged for every data_parallel table whether or not cache parameters were given (the app gives none).
    _drop_log_records("torchrec.distributed.utils", "Sharding Type is data_parallel, caching params will be ignored")


_DROPPED: set[tuple[str, str]] = set()  # (logger, message start) filters installed in this process


def _drop_log_records(logger_name: str, start: str) -> None:
    """Drop the records logged to ``logger_name`` itself whose message starts with ``start``."""
    if (logger_name, start) in _DROPPED:
        return  # cli_main can run more than once in a process (tests)
    _DROPPED.add((logger_name, start))
    logging.getLogger(logger_name).addFilter(lambda record: not record.getMessage().startswith(start))
