"""TorchRec's training pipelines inside Lightning, on 2 CPU processes (gloo), against the plain loop.

One plain run and one ``sparse_dist`` run of 2 epochs with a validation in the middle of each epoch
and a checkpoint every 5 steps; the pipelined run must train the very same batches in the same order
to the same losses, bit for bit, evaluate exactly what the plain run evaluates, stop on ``max_steps``
and resume mid-epoch to the uninterrupted end.
"""

from __future__ import annotations

import numpy as np
import pytest

from multiprocess import run_on_ranks
from test_sharding import fit_args, shards_and_predictions

STEPS_PER_EPOCH = 12  # 1,536 rows / (2 ranks x 64)


def probed(cli) -> dict:
    """shards_and_predictions plus the training probe's records."""
    result = shards_and_predictions(cli)
    (probe,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "TrainingProbe"]
    result.update(steps=probe.steps, validations=probe.validations)
    return result


def pipeline_args(sample, root, pipeline: str) -> list[str]:
    return fit_args(sample, root, "table_wise", 64) + [
        "--model.pipeline", pipeline,
        "--trainer.val_check_interval", "0.5",
        "--trainer.callbacks+=training_probe.TrainingProbe",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def plain(sample, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("plain")
    return run_on_ranks(2, pipeline_args(sample, root, "none"), root, probed)


def test_sparse_dist_trains_the_plain_loops_batches_to_the_same_losses(sample, plain, tmp_path):
    pipelined = run_on_ranks(2, pipeline_args(sample, tmp_path, "sparse_dist"), tmp_path, probed)
    for rank in range(2):
        print(rank, [s[2] for s in plain[rank]["steps"]][:5], [s[2] for s in pipelined[rank]["steps"]][:5])
        print([(s[0], s[1]) for s in pipelined[rank]["steps"]])
        print([(g, len(r)) for g, r in pipelined[rank]["validations"]], [(g, len(r)) for g, r in plain[rank]["validations"]])
        for x, y in zip(plain[rank]["steps"], pipelined[rank]["steps"]):
            print(x[:3], y[:3], x[3] == y[3])
        assert pipelined[rank]["steps"] == plain[rank]["steps"]
    np.testing.assert_array_equal(pipelined[0]["probabilities"], plain[0]["probabilities"])
