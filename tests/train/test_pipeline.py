"""TorchRec's training pipelines inside Lightning, on 2 CPU processes (gloo), against the plain loop.

A plain run and a ``sparse_dist`` run of 17 steps (12 per epoch, so the run stops in the middle of
the second epoch), each validating twice per epoch: the pipelined run must train the very same
batches in the same order to the same losses, bit for bit, evaluate to the same metrics (no
prefetched training batch leaks into evaluation), stop on ``max_steps``, and a checkpoint it wrote
mid-epoch must resume to exactly where it ended. Both runs clip gradients by value
(``trainer.gradient_clip_val``), which Lightning leaves to the module under the pipeline's manual
optimization. (``semi_sync`` runs on GPUs only: TorchRec's semi-sync pipeline records CUDA streams.)
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from app.train.module import DLRMModule
from app.train.pipeline import carry_step_count, resolve_pipeline
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args, shards_and_predictions

STEPS_PER_EPOCH = 12  # 1,536 rows / (2 ranks x 64)
MAX_STEPS = 17
TRAIN_ROWS, VAL_ROWS = 1_536, 300
LOG_EVERY_N_STEPS = 4
# Small enough that every step clips some gradient: the largest one left is then exactly this value.
GRADIENT_CLIP_VALUE = 1e-4


def probed(cli) -> dict:
    """shards_and_predictions plus the training probe's records."""
    result = shards_and_predictions(cli)
    (probe,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "TrainingProbe"]
    (gradients,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "GradientProbe"]
    result.update(steps=probe.steps, validations=probe.validations, root=cli.trainer.default_root_dir)
    result.update(largest_gradients=gradients.largest)
    return result


def pipeline_args(sample, root, pipeline: str, *extra: str) -> list[str]:
    args = fit_args(sample, root, "table_wise", 64) + [
        "--model.pipeline", pipeline,
        "--trainer.max_steps", str(MAX_STEPS),
        "--trainer.val_check_interval", "0.5",
        "--trainer.callbacks+=tests.training_probe.TrainingProbe",
        "--trainer.callbacks+=tests.train.gradient_probe.GradientProbe",
        "--trainer.callbacks+=tests.training_probe.StepClock",
        "--trainer.gradient_clip_val", str(GRADIENT_CLIP_VALUE),
        "--trainer.gradient_clip_algorithm", "value",
        "--trainer.log_every_n_steps", str(LOG_EVERY_N_STEPS),
        "--trainer.logger.class_path", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.init_args.save_dir", str(root),
        "--trainer.logger.init_args.name", "logs",
        *extra,
    ]  # fmt: skip
    del args[args.index("--trainer.logger") : args.index("--trainer.logger") + 2]  # fit_args turns logging off
    return args


@pytest.fixture(scope="module")
def plain(sample, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("plain")
    return run_on_ranks(2, pipeline_args(sample, root, "none"), root, probed)


@pytest.fixture(scope="module")
def sparse_dist(sample, tmp_path_factory) -> dict:
    """The sparse_dist run, checkpointing every 9 steps: step 9 is between epoch 0's two validations."""
    root = tmp_path_factory.mktemp("sparse_dist")
    every_9_steps = [
        "--checkpoint.filename", "{step}",
        "--checkpoint.every_n_train_steps", "9",
        "--checkpoint.save_top_k", "-1",
        "--checkpoint.monitor", "null",
        "--checkpoint.save_last", "false",
    ]  # fmt: skip
    args = pipeline_args(sample, root, "sparse_dist")
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    ranks = run_on_ranks(2, args + every_9_steps, root, probed)
    assert sorted(p.name for p in (root / "checkpoints").glob("*.ckpt")) == ["step=9.ckpt"]
    return {"ranks": ranks, "args": args, "checkpoints": root / "checkpoints"}


def test_sparse_dist_trains_the_same_batches_to_the_same_losses_bit_for_bit(plain, sparse_dist):
    for rank in range(2):
        pipelined = sparse_dist["ranks"][rank]
        # (epoch, global_step, loss, row ids) of every step: global_step advances once per batch.
        assert [s[:2] for s in pipelined["steps"]] == [(i // STEPS_PER_EPOCH, i + 1) for i in range(MAX_STEPS)]
        assert pipelined["steps"] == plain[rank]["steps"]
        assert pipelined["global_step"] == MAX_STEPS
    np.testing.assert_array_equal(sparse_dist["ranks"][0]["probabilities"], plain[0]["probabilities"])


def test_gradient_clipping_applies_in_the_pipelined_step_as_in_the_plain_loop(plain, sparse_dist):
    clipped = float(torch.tensor(GRADIENT_CLIP_VALUE))  # as float32 gradients hold it
    for rank in range(2):
        assert plain[rank]["largest_gradients"] == [clipped] * MAX_STEPS
        assert sparse_dist["ranks"][rank]["largest_gradients"] == [clipped] * MAX_STEPS
        assert sparse_dist["ranks"][rank]["steps"] == plain[rank]["steps"]


def weights_and_gradients(cli) -> dict:
    """Every parameter after training (a one-rank run: whole tables), and the largest gradient left
    on the dense layers and on the tables that have one (replicated: fused ones have none)."""
    module = cli.trainer.lightning_module
    weights = {
        key: (value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value).clone()
        for key, value in module.state_dict().items()
    }
    largest = {"dense": 0.0, "tables": 0.0}
    for name, parameter in module.named_parameters():
        if isinstance(parameter.grad, torch.Tensor):
            part = "tables" if ".embedding_bags." in name else "dense"
            largest[part] = max(largest[part], float(parameter.grad.abs().max()))
    return {"weights": weights, "largest_gradients": largest}


def test_gradient_clipping_clips_the_dense_layers_and_leaves_every_table_alone(sample, tmp_path):
    # One step from the same start with and without clipping, t_cat_0 replicated (data_parallel: its
    # gradient is in Lightning's optimizer), the other tables fused (updated inside backward).
    replicated = "model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"
    runs = {}
    for clip in (None, GRADIENT_CLIP_VALUE):
        root = tmp_path / f"clip_{clip}"
        args = fit_args(sample, root, "table_wise", 128) + [
            "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0",
            "--trainer.strategy.table_constraints", "{t_cat_0: {sharding_types: [data_parallel]}}",
        ]  # fmt: skip
        if clip is not None:
            args += ["--trainer.gradient_clip_val", str(clip), "--trainer.gradient_clip_algorithm", "value"]
        (runs[clip],) = run_on_ranks(1, args, root, weights_and_gradients)
    unclipped, clipped = runs[None], runs[GRADIENT_CLIP_VALUE]
    # The dense layers' gradients clipped to the value, the replicated table's left as it was.
    assert clipped["largest_gradients"]["dense"] == float(torch.tensor(GRADIENT_CLIP_VALUE))
    assert unclipped["largest_gradients"]["dense"] > 100 * GRADIENT_CLIP_VALUE
    assert clipped["largest_gradients"]["tables"] == unclipped["largest_gradients"]["tables"] > GRADIENT_CLIP_VALUE
    tables = [key for key in unclipped["weights"] if ".embedding_bags." in key]
    assert len(tables) == 26 and replicated in tables
    for key, weight in unclipped["weights"].items():
        if key in tables:  # fused and replicated tables alike: the update of the unclipped run
            assert torch.equal(clipped["weights"][key], weight), key
    dense = [key for key in unclipped["weights"] if key.startswith("model.") and key not in tables]
    assert dense and all(not torch.equal(clipped["weights"][key], unclipped["weights"][key]) for key in dense)


def test_validation_mid_epoch_neither_loses_nor_repeats_a_training_batch(plain, sparse_dist):
    ranks = sparse_dist["ranks"]
    first_epoch = [row for rank in ranks for s in rank["steps"] if s[0] == 0 for row in s[3]]
    assert sorted(first_epoch) == list(range(TRAIN_ROWS))  # every row once, across both ranks
    second_epoch = [row for rank in ranks for s in rank["steps"] if s[0] == 1 for row in s[3]]
    assert len(second_epoch) == len(set(second_epoch)) == 2 * 64 * (MAX_STEPS - STEPS_PER_EPOCH)
    for rank in range(2):
        # Validations after steps 6 and 12 (mid-epoch and epoch end), none at the max_steps stop.
        assert [v[0] for v in ranks[rank]["validations"]] == [6, 12]
        assert [v[0] for v in plain[rank]["validations"]] == [6, 12]
        for pipelined_pass, plain_pass in zip(ranks[rank]["validations"], plain[rank]["validations"]):
            (_, rows, logloss), (_, plain_rows, plain_logloss) = pipelined_pass, plain_pass
            assert rows == plain_rows
            assert logloss == plain_logloss  # a training batch leaking into evaluation would change this
    val_rows = sorted(r for rank in ranks for r in rank["validations"][0][1] if r >= 0)
    assert val_rows == list(range(VAL_ROWS))


@pytest.mark.parametrize("resumed_pipeline", ["sparse_dist", "none"])
def test_a_mid_epoch_checkpoint_resumes_to_where_the_uninterrupted_run_ended(sparse_dist, resumed_pipeline, tmp_path):
    # Resumed with the plain loop too: Lightning counts the pipelined (manual) steps apart from the
    # plain loop's (automatic), and without carry_step_count that run restarted at global_step 0.
    checkpoints = sparse_dist["checkpoints"]
    args = list(sparse_dist["args"])
    args[args.index("--model.pipeline") + 1] = resumed_pipeline
    for setting in ("--trainer.default_root_dir", "--trainer.logger.init_args.save_dir"):
        args[args.index(setting) + 1] = str(tmp_path)  # its own folder: the writer's keeps only its own files
    resumed = run_on_ranks(2, args + ["--ckpt_path", str(checkpoints / "step=9.ckpt")], tmp_path, probed)
    for rank in range(2):
        uninterrupted = sparse_dist["ranks"][rank]
        # The resumed run trains steps 10..17 on the batches the uninterrupted run trained there.
        assert resumed[rank]["steps"] == uninterrupted["steps"][9:]
        assert resumed[rank]["global_step"] == MAX_STEPS
    np.testing.assert_array_equal(resumed[0]["probabilities"], sparse_dist["ranks"][0]["probabilities"])


def test_train_loss_is_written_every_n_steps_as_the_mean_since_the_last_write(plain, sparse_dist):
    for rank0 in (plain[0], sparse_dist["ranks"][0]):
        with next(Path(rank0["root"]).glob("logs/version_0/metrics.csv")).open() as f:
            rows = [row for row in csv.DictReader(f) if row.get("train/loss")]
        # Lightning writes step metrics after every 4th batch; its step column counts from 0.
        written_batches = list(range(LOG_EVERY_N_STEPS, MAX_STEPS + 1, LOG_EVERY_N_STEPS))
        assert [int(row["step"]) for row in rows] == [n - 1 for n in written_batches]
        # Under a clock of one second per step: the 64 rows of each of the 2 ranks, per step.
        assert [float(row["train/samples_per_sec"]) for row in rows] == [2 * 64.0] * len(written_batches)
        losses = [step[2] for step in rank0["steps"]]
        expected = [np.mean(losses[n - LOG_EVERY_N_STEPS : n], dtype=np.float32) for n in written_batches]
        assert [float(row["train/loss"]) for row in rows] == pytest.approx(expected, rel=1e-6)


def test_sparse_dist_lite_trains_the_same_batches_to_the_same_losses_bit_for_bit(plain, sample, tmp_path):
    # One batch in flight instead of two, paused and resumed around the validations as sparse_dist is.
    lite = run_on_ranks(2, pipeline_args(sample, tmp_path, "sparse_dist_lite"), tmp_path, probed)
    for rank in range(2):
        assert lite[rank]["steps"] == plain[rank]["steps"] and lite[rank]["global_step"] == MAX_STEPS
        assert lite[rank]["validations"] == plain[rank]["validations"]
    np.testing.assert_array_equal(lite[0]["probabilities"], plain[0]["probabilities"])


@pytest.mark.parametrize("name", ["semi_sync", "fused_sparse_dist"])
def test_gpu_only_pipelines_are_refused_on_cpu_before_any_worker_starts(name):
    # Both record CUDA streams on the batches they hold; on CPU they fail deep inside the first step.
    with pytest.raises(ValueError, match=f"model.pipeline = {name} needs GPUs: TorchRec's .* does not run on cpu; use sparse_dist"):
        resolve_pipeline(name, torch.device("cpu"), 2)
    with pytest.raises(ValueError, match=f"model.pipeline = {name} needs GPUs"):
        DLRMModule(pipeline=name, num_embeddings_per_feature=10).check_before_launch("cpu", "fit")  # the CLI's first check
    assert resolve_pipeline(name, torch.device("cuda", 0), 1) == name


def test_unknown_pipelines_name_the_setting_and_every_choice():
    with pytest.raises(
        ValueError,
        match="model.pipeline = 'sparse' is not one of auto, none, sparse_dist, semi_sync, sparse_dist_lite, fused_sparse_dist",
    ):
        DLRMModule(pipeline="sparse")


@pytest.mark.parametrize(
    ("device", "world_size", "expected"),
    [
        ("cuda", 1, "sparse_dist"),  # the host-to-device copy to overlap
        ("cuda", 8, "sparse_dist"),
        ("cpu", 2, "sparse_dist"),  # the input all-to-all to overlap (measured faster, app/train/pipeline.py)
        ("cpu", 1, "none"),  # nothing to overlap: the pipeline's bookkeeping alone
    ],
)
def test_auto_pipelines_wherever_there_is_something_to_overlap(device, world_size, expected):
    assert resolve_pipeline("auto", torch.device(device), world_size) == expected
    assert resolve_pipeline("none", torch.device(device), world_size) == "none"


def _loops(automatic_steps: int, manual_steps: int) -> dict:
    """The two step counters of a checkpoint's fit loop, as Lightning 2.6 saves them."""
    def steps(n: int) -> dict:
        return {"total": {"ready": n, "completed": n}, "current": {"ready": n, "completed": n}}

    return {"loops": {"fit_loop": {
        "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": steps(automatic_steps), "zero_grad": {}}},
        "epoch_loop.manual_optimization.optim_step_progress": steps(manual_steps),
    }}}  # fmt: skip


@pytest.mark.parametrize(
    ("saved", "automatic_optimization", "expected"),
    [
        (_loops(0, 9), True, _loops(9, 0)),  # pipelined checkpoint, plain loop resumes
        (_loops(9, 0), False, _loops(0, 9)),  # plain checkpoint, pipeline resumes
        (_loops(9, 0), True, _loops(9, 0)),  # same loop: unchanged
        (_loops(4, 5), False, _loops(0, 9)),  # a checkpoint of older runs that switched: the sum
    ],
)
def test_a_checkpoint_of_the_other_loop_keeps_its_step_count(saved, automatic_optimization, expected):
    carry_step_count(saved, automatic_optimization)
    assert saved == expected
    exported = {"state_dict": {}}  # no loops: left alone
    carry_step_count(exported, True)
    assert exported == {"state_dict": {}}


# ---- model.compile: the compiled dense layers against the eager runs above --------------------------

# Inductor fuses bias, ReLU and their backward and reorders sums: float32 results differ from eager in
# the last bits, and the differences grow with the steps. Measured here: at most ~1e-6 relative.
COMPILED_LOSS_RTOL = 1e-4


def compiled_probe(cli) -> dict:
    """probed plus which layers ran compiled and how many graphs Dynamo built."""
    from torch._dynamo.utils import counters

    from app.model.compile import compiled_layer_names

    result = probed(cli)
    result.update(compiled=compiled_layer_names(cli.model.model), graphs=counters["stats"]["unique_graphs"])
    return result


def assert_same_steps_to_tolerance(steps: list, expected: list) -> None:
    """The same (epoch, global_step) and batch rows; losses equal to COMPILED_LOSS_RTOL."""
    assert [(s[0], s[1], s[3]) for s in steps] == [(s[0], s[1], s[3]) for s in expected]
    assert [s[2] for s in steps] == pytest.approx([s[2] for s in expected], rel=COMPILED_LOSS_RTOL)


@pytest.fixture(scope="module")
def compiled_sparse_dist(sample, tmp_path_factory) -> dict:
    """The sparse_dist run of the fixture above with model.compile on, checkpointing at step 9."""
    root = tmp_path_factory.mktemp("compiled_sparse_dist")
    args = pipeline_args(sample, root, "sparse_dist", "--model.compile", "true")
    args[args.index("--trainer.enable_checkpointing") + 1] = "true"
    args += ["--checkpoint.filename", "{step}", "--checkpoint.every_n_train_steps", "9", "--checkpoint.save_top_k", "-1",
             "--checkpoint.monitor", "null", "--checkpoint.save_last", "false"]  # fmt: skip
    ranks = run_on_ranks(2, args, root, compiled_probe)
    return {"ranks": ranks, "args": args, "checkpoints": root / "checkpoints"}


def test_compiled_dense_layers_train_the_same_batches_to_the_same_losses_through_the_pipeline(plain, compiled_sparse_dist):
    for rank in range(2):
        compiled = compiled_sparse_dist["ranks"][rank]
        assert compiled["compiled"] == ["dense_arch", "inter_arch", "over_arch"]
        assert compiled["graphs"] > 0  # Dynamo compiled them (not a run that fell back to eager)
        assert_same_steps_to_tolerance(compiled["steps"], plain[rank]["steps"])
        for compiled_pass, eager_pass in zip(compiled["validations"], plain[rank]["validations"], strict=True):
            assert compiled_pass[:2] == eager_pass[:2]
            assert compiled_pass[2] == pytest.approx(eager_pass[2], rel=COMPILED_LOSS_RTOL)
    np.testing.assert_allclose(compiled_sparse_dist["ranks"][0]["probabilities"], plain[0]["probabilities"], rtol=1e-3)


def test_a_compiled_run_checkpoint_resumes_eager(compiled_sparse_dist, tmp_path):
    args = list(compiled_sparse_dist["args"])
    args[args.index("--model.compile") + 1] = "false"
    for setting in ("--trainer.default_root_dir", "--trainer.logger.init_args.save_dir"):
        args[args.index(setting) + 1] = str(tmp_path)
    resumed = run_on_ranks(2, args + ["--ckpt_path", str(compiled_sparse_dist["checkpoints"] / "step=9.ckpt")], tmp_path, compiled_probe)
    for rank in range(2):
        assert resumed[rank]["compiled"] == []
        assert_same_steps_to_tolerance(resumed[rank]["steps"], compiled_sparse_dist["ranks"][rank]["steps"][9:])


def test_an_eager_checkpoint_resumes_compiled_in_the_plain_loop(sparse_dist, tmp_path):
    args = list(sparse_dist["args"])
    args[args.index("--model.pipeline") + 1] = "none"
    for setting in ("--trainer.default_root_dir", "--trainer.logger.init_args.save_dir"):
        args[args.index(setting) + 1] = str(tmp_path)
    resumed = run_on_ranks(2, args + ["--model.compile", "true", "--ckpt_path", str(sparse_dist["checkpoints"] / "step=9.ckpt")],
                           tmp_path, compiled_probe)  # fmt: skip
    for rank in range(2):
        assert resumed[rank]["compiled"] == ["dense_arch", "inter_arch", "over_arch"] and resumed[rank]["graphs"] > 0
        assert_same_steps_to_tolerance(resumed[rank]["steps"], sparse_dist["ranks"][rank]["steps"][9:])


# ---- strategy qcomms: fp16 pooled-embedding all-to-all against the uncompressed runs above ----------

# fp16 keeps 11 significant bits: each pooled embedding sent loses up to ~5e-4 of itself, forward and back.
QCOMMS_FP16_LOSS_RTOL = 5e-3


def qcomms_probe(cli) -> dict:
    """probed plus the precisions of the codecs on the sharded module's pooled-embedding all-to-alls."""
    from torchrec.distributed.dist_data import PooledEmbeddingsAllToAll

    result = probed(cli)
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    # TorchRec keeps a sharded collection's output dists in a plain list: not among its submodules.
    (sharded,) = [m for m in cli.trainer.strategy.model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
    dists = [m for dist in sharded._output_dists for m in dist.modules() if isinstance(m, PooledEmbeddingsAllToAll)]
    result["codec_dtypes"] = [
        (str(d._codecs.forward.quantized_dtype), str(d._codecs.backward.quantized_dtype)) if d._codecs else None
        for d in dists
    ]
    return result


def test_fp16_communication_reaches_the_sharded_all_to_all_and_trains_to_the_uncompressed_losses(sample, plain, tmp_path):
    qcomms = ["--trainer.strategy.init_args.qcomms", "{forward_precision: fp16, backward_precision: fp16}"]
    ranks = run_on_ranks(2, pipeline_args(sample, tmp_path, "sparse_dist", *qcomms), tmp_path, qcomms_probe)
    for rank in range(2):
        # Table-wise on 2 ranks: one pooled all-to-all, both directions fp16.
        assert ranks[rank]["codec_dtypes"] == [("torch.float16", "torch.float16")]
        steps, uncompressed = ranks[rank]["steps"], plain[rank]["steps"]
        assert [(s[0], s[1], s[3]) for s in steps] == [(s[0], s[1], s[3]) for s in uncompressed]
        losses = [s[2] for s in steps]
        assert losses == pytest.approx([s[2] for s in uncompressed], rel=QCOMMS_FP16_LOSS_RTOL)
        assert losses != [s[2] for s in uncompressed]  # it did compress: fp16 rounding shows in the losses
