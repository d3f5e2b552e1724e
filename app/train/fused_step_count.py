"""Evaluation leaves the step count of FBGEMM's fused embedding optimizers where training left it.

FBGEMM's Adam (and LAMB) reads its bias correction from a step count kept in each kernel, and every
forward of the kernel advances it, evaluation batches included. So without this a run that
validates in the middle of an epoch trains on with another correction than the same run validating
less often, and a run resumed from a checkpoint, where the count restored is the
number of training steps (app/checkpoint/format.py, ``restore_fused_optimizer_step``), trains on
with another correction than the run that wrote it.

TorchRec exposes a setter for the count (``set_optimizer_step``) but no getter, and the setter
leaves the copy the kernel computes with (``iter_cpu``) alone once a forward has run; hence the
kernels' own buffers, written by hand here.
"""

from __future__ import annotations

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen


class FusedStepCount:
    """Holds the kernels' step counts at the start of an evaluation and puts them back at its end."""

    def __init__(self) -> None:
        self._held: list[tuple[SplitTableBatchedEmbeddingBagsCodegen, int]] = []

    def hold(self, module: torch.nn.Module) -> None:
        """Notes the count of every FBGEMM training kernel in ``module`` (one host sync per kernel)."""
        self._held = [(kernel, int(kernel.iter.item())) for kernel in training_kernels(module)]

    def put_back(self) -> None:
        """Sets each held kernel's count, and the copy it computes with, to the count held."""
        for kernel, count in self._held:
            # The kernel copies ``iter`` into ``iter_cpu`` only while ``iter_cpu`` is 0 (a fresh kernel);
            # once the two have met they advance together, so both are set alike.
            kernel.iter.fill_(count)
            kernel.iter_cpu.fill_(count)
        self._held = []


def training_kernels(module: torch.nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """FBGEMM's training kernels under ``module``: those of TorchRec's fused and UVM compute kernels
    (data-parallel tables use dense kernels, which keep no count)."""
    # TorchRec keeps a sharded collection's lookups in a plain list (``_lookups``), out of the module
    # tree, so ``module.modules()`` alone never reaches the kernels.
    return [
        kernel
        for sharded in module.modules()
        for lookup in getattr(sharded, "_lookups", None) or []
        for kernel in lookup.modules()
        if isinstance(kernel, SplitTableBatchedEmbeddingBagsCodegen)
    ]
