"""Checkpoints on GPUs: resume from ``last`` exactly, a CPU checkpoint resumed on a GPU and a GPU
checkpoint resumed on CPU, a 2-process CPU (gloo) checkpoint validated on one GPU, and an exported
model predicting on a GPU what it predicts on CPU.

Tolerances (see test_gpu_training.py): the same computation on the same device to 1e-6; the same
weights through CPU and GPU kernels to 1e-5; training that crossed devices mid-way to 1e-4.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.gpu_runs import GPU, losses, max_abs_difference, with_settings
from tests.reshard_runs import eval_args, plan_args

pytestmark = pytest.mark.gpu

STOP_AT = 10  # mid-epoch (12 steps per epoch), between the validations after steps 6 and 12
# last.ckpt every 5 steps: the run stopped by max_steps = 10 leaves it at step 10.
CHECKPOINT_EVERY_5 = {
    "trainer__enable_checkpointing": "true",
    "checkpoint__every_n_train_steps": "5",
    "checkpoint__monitor": "null",
    "checkpoint__save_top_k": "0",
    "checkpoint__save_last": "true",
}
ON_CPU = {"trainer__accelerator": "cpu"}  # the same run on one CPU process (gloo)


def _stopped(app_runs, args: list[str], name: str) -> dict:
    """``args`` run to step 10 with last.ckpt saved."""
    (run,) = app_runs(name, 1, with_settings(args, trainer__max_steps=str(STOP_AT), **CHECKPOINT_EVERY_5))
    assert run["global_step"] == STOP_AT
    return run


def _with_last_of(stopped: dict):
    """A ``prepare`` for app_runs: a copy of the stopped run's checkpoints in the new run's folder, so
    that ``--ckpt_path last`` finds it there and the stopped run's own files stay as they were."""
    return lambda root: shutil.copytree(Path(stopped["root"]) / "checkpoints", root / "checkpoints", symlinks=False)


def _last(run: dict) -> str:
    return str(Path(run["root"]) / "checkpoints" / "last.ckpt")


def _evaluate(args: list[str], subcommand: str, checkpoint: str) -> list[str]:
    evaluated = [subcommand, *args[1:], "--ckpt_path", checkpoint]
    evaluated.remove("--trainer.callbacks+=tests.embedding_init.ReferenceEmbeddings")  # fit-only; not to overwrite what is loaded
    return evaluated


def _check_continues(resumed: dict, uninterrupted: dict, loss_atol: float) -> float:
    """The resumed run trained steps 11..24 on the batches the uninterrupted run trained there, to
    its losses; returns the largest loss difference."""
    assert resumed["global_step"] == uninterrupted["global_step"] == 24
    later = uninterrupted["steps"][STOP_AT:]
    assert [s[:2] for s in resumed["steps"]] == [s[:2] for s in later]  # (epoch, global_step)
    assert [s[3] for s in resumed["steps"]] == [s[3] for s in later]  # the same rows, in order
    difference = max_abs_difference(losses(resumed), [s[2] for s in later])
    np.testing.assert_allclose(losses(resumed), [s[2] for s in later], rtol=0, atol=loss_atol)
    return difference


@pytest.mark.parametrize("sparse, dense", [("row_wise_adagrad", "sgd"), ("adam", "adam")])
def test_resuming_from_last_reproduces_the_uninterrupted_run(sparse, dense, app_runs, reference_args, record_property):
    # Adam: FBGEMM's fused Adam keeps no step count of its own; a resume that restarted
    # its bias correction would train other losses after step 10.
    args = with_settings(reference_args, model__sparse_optimizer=sparse, model__dense_optimizer=dense)
    (uninterrupted,) = app_runs("reference" if sparse == "row_wise_adagrad" else f"optimizers_{sparse}_{dense}", 1, args)
    stopped = _stopped(app_runs, args, f"stopped_{sparse}_{dense}")
    # Resumed as the stopped run was started, checkpointing on: Lightning finds ``last`` through the run's
    # ModelCheckpoint, and without one starts afresh with a warning (seen on an H200: 24 steps from step 1).
    resumed_args = with_settings(args, **CHECKPOINT_EVERY_5) + ["--ckpt_path", "last"]
    (resumed,) = app_runs(f"resumed_last_{sparse}_{dense}", 1, resumed_args, prepare=_with_last_of(stopped))
    record_property("max_abs_loss_difference", _check_continues(resumed, uninterrupted, loss_atol=1e-6))
    assert [v[0] for v in resumed["validations"]] == [12, 18, 24]
    for resumed_pass, uninterrupted_pass in zip(resumed["validations"], uninterrupted["validations"][1:]):
        assert resumed_pass[2] == pytest.approx(uninterrupted_pass[2], abs=1e-6)
    np.testing.assert_allclose(resumed["probabilities"], uninterrupted["probabilities"], rtol=0, atol=1e-6)


def test_a_cpu_checkpoint_resumes_on_a_gpu(app_runs, reference_args, reference, record_property):
    cpu_args = with_settings(reference_args, **ON_CPU)
    cpu_stopped = _stopped(app_runs, cpu_args, "cpu_stopped")
    assert cpu_stopped["device"] == "cpu" and cpu_stopped["backend"] == "gloo"
    # Its plan places shards on "rank:0/cpu": on the GPU they must land on cuda (issue 16 item 2).
    (restored,) = app_runs("cpu_checkpoint_validated_on_gpu", 1, _evaluate(reference_args, "validate", _last(cpu_stopped)))
    assert restored["device"].startswith("cuda") and restored["table_devices"] == ["cuda"]
    record_property("max_abs_probability_difference_restored", max_abs_difference(restored["probabilities"], cpu_stopped["probabilities"]))
    np.testing.assert_allclose(restored["probabilities"], cpu_stopped["probabilities"], rtol=0, atol=1e-5)

    (resumed,) = app_runs("cpu_checkpoint_resumed_on_gpu", 1, reference_args + ["--ckpt_path", _last(cpu_stopped)])
    assert resumed["device"].startswith("cuda") and all(math.isfinite(loss) for loss in losses(resumed))
    record_property("max_abs_loss_difference_vs_gpu_only", _check_continues(resumed, reference, loss_atol=1e-4))
    np.testing.assert_allclose(resumed["probabilities"], reference["probabilities"], rtol=0, atol=1e-4)


def test_a_gpu_checkpoint_resumes_on_cpu(app_runs, reference_args, reference, record_property):
    gpu_stopped = _stopped(app_runs, reference_args, "stopped_row_wise_adagrad_sgd")  # shared with the resume check
    cpu_args = with_settings(reference_args, **ON_CPU)
    (restored,) = app_runs("gpu_checkpoint_validated_on_cpu", 1, _evaluate(cpu_args, "validate", _last(gpu_stopped)))
    assert restored["device"] == "cpu" and restored["table_devices"] == ["cpu"]
    record_property("max_abs_probability_difference_restored", max_abs_difference(restored["probabilities"], gpu_stopped["probabilities"]))
    np.testing.assert_allclose(restored["probabilities"], gpu_stopped["probabilities"], rtol=0, atol=1e-5)

    (resumed,) = app_runs("gpu_checkpoint_resumed_on_cpu", 1, cpu_args + ["--ckpt_path", _last(gpu_stopped)])
    assert resumed["device"] == "cpu"
    record_property("max_abs_loss_difference_vs_gpu_only", _check_continues(resumed, reference, loss_atol=1e-4))
    np.testing.assert_allclose(resumed["probabilities"], reference["probabilities"], rtol=0, atol=1e-4)


def test_a_two_process_cpu_checkpoint_validates_on_one_gpu(checkpoint_writer, sample, app_runs, record_property):
    # The CPU suite's writer: 2 processes with gloo, t_cat_0 replicated, t_cat_1 split in columns, the
    # rest table-wise; read back into one GPU's table-wise plan.
    checkpoint = checkpoint_writer["root"] / "checkpoints" / "step=16.ckpt"
    args = eval_args(sample, Path("{root}"), "validate", 1, checkpoint, plan_args("table_wise", {})) + GPU
    (run,) = app_runs("two_process_checkpoint_on_gpu", 1, args)
    assert run["device"].startswith("cuda") and run["backend"] == "nccl"
    expected = checkpoint_writer["result"]["probabilities"]
    record_property("max_abs_probability_difference_vs_cpu", max_abs_difference(run["probabilities"], expected))
    record_property("val_metrics", {k: v for k, v in run["callback_metrics"].items() if k.startswith("val/")})
    np.testing.assert_allclose(run["probabilities"], expected, rtol=0, atol=1e-5)


def test_an_exported_model_predicts_on_a_gpu_what_it_predicts_on_cpu(checkpoint_writer, sample, app_runs, tmp_path_factory, record_property):
    from app.checkpoint.export import export_checkpoint

    step16 = checkpoint_writer["root"] / "checkpoints" / "step=16.ckpt"
    model = export_checkpoint(str(step16), str(tmp_path_factory.mktemp("export") / "model.pt"))
    args = eval_args(sample, Path("{root}"), "predict", 1, model, plan_args("table_wise", {}))
    (cpu,) = app_runs("export_predict_cpu", 1, args)
    (gpu,) = app_runs("export_predict_gpu", 1, args + GPU)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda")
    # The same fp32 weights through CPU and GPU kernels: sums in another order, ~1e-7 relative per
    # layer; 1e-5 on a probability is ten times what that can add up to here.
    record_property("max_abs_probability_difference", max_abs_difference(gpu["probabilities"], cpu["probabilities"]))
    np.testing.assert_allclose(gpu["probabilities"], cpu["probabilities"], rtol=0, atol=1e-5)
    written = {}
    for name, run in (("cpu", cpu), ("gpu", gpu)):
        lines = (Path(run["root"]) / "predictions.tsv").read_text().splitlines()
        assert lines[0] == "row_id\tprobability"
        assert [int(line.split("\t")[0]) for line in lines[1:]] == list(range(300))  # every row once, in order
        written[name] = np.array([float(line.split("\t")[1]) for line in lines[1:]])
    # 6 decimals in the file: at most 1e-6 more between the two files.
    np.testing.assert_allclose(written["gpu"], written["cpu"], rtol=0, atol=1.1e-5)
