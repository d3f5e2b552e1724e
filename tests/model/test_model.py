"""The DLRM variants and the metrics, on one process without sharding; and the cat and projection
interactions trained through the app to their measured values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES

from app.criteo import NUM_DENSE, NUM_SPARSE, expand_table_sizes
from app.data.batches import make_batch
from app.data.source import RowBlock
from app.model.dlrm import INTERACTIONS, Float32Linear, build_dlrm
from app.train.metrics import LogLoss, NormalizedEntropy
from tests.multiprocess import run_on_ranks
from tests.distributed.test_sharding import fit_args


# Every interaction's settings, small: 26 tables of 10 rows x 8 on the CPU.
SMALL_DLRM = dict(
    embedding_dim=8,
    num_embeddings_per_feature=[10] * 26,
    dense_arch_layer_sizes=[16, 8],
    over_arch_layer_sizes=[16, 1],
    dcn_num_layers=2,
    dcn_low_rank_dim=4,
    interaction_branch1_layer_sizes=[32, 16],
    interaction_branch2_layer_sizes=[32, 24],
    embedding_device="cpu",
)


def _batch(batch_size: int = 5):
    rng = np.random.default_rng(0)
    block = RowBlock(
        dense=rng.random((batch_size, 13), dtype=np.float32),
        sparse=rng.integers(0, 10, (batch_size, 26)),
        labels=rng.integers(0, 2, batch_size).astype(np.float32),
    )
    return make_batch(block, np.arange(batch_size))


@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_every_interaction_gives_one_logit_per_row(interaction):
    torch.manual_seed(0)
    model = build_dlrm(interaction=interaction, **SMALL_DLRM)
    batch = _batch()
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (5, 1)
    assert torch.isfinite(logits).all()
    logits.sum().backward()  # every part is trainable
    assert all(p.grad is not None for p in model.parameters())


def test_cat_interaction_feeds_all_embeddings_to_the_top_mlp():
    model = build_dlrm(
        interaction="cat",
        embedding_dim=8,
        num_embeddings_per_feature=[10] * 26,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        embedding_device="cpu",
    )
    first_top_layer = next(m for m in model.over_arch.modules() if isinstance(m, torch.nn.Linear))
    assert first_top_layer.in_features == (26 + 1) * 8


def test_tables_start_on_the_meta_device_by_default():
    model = build_dlrm(
        interaction="dot", embedding_dim=4, num_embeddings_per_feature=[10**9] * 26,
        dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
    )  # fmt: skip
    assert {p.device.type for p in model.sparse_arch.parameters()} == {"meta"}  # 26e9 rows cost nothing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interaction": "dcnv3"}, "model.interaction = 'dcnv3' is not one of dot, cat, dcn, projection"),
        ({"dense_arch_layer_sizes": [16, 4]}, "model.dense_arch_layer_sizes = [16, 4] must end with embedding_dim = 8"),
        ({"over_arch_layer_sizes": [16, 2]}, "model.over_arch_layer_sizes = [16, 2] needs at least two layers"),
        ({"num_embeddings_per_feature": [10] * 27}, "has 27 sizes"),
        (
            {"interaction": "projection", "interaction_branch1_layer_sizes": [32, 12]},
            "model.interaction_branch1_layer_sizes[-1] = 12 must be a multiple of embedding_dim = 8",
        ),
    ],
)
def test_bad_model_settings_are_named(kwargs, message):
    settings = dict(
        interaction="dot", embedding_dim=8, num_embeddings_per_feature=[10] * 26,
        dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 1],
    )  # fmt: skip
    with pytest.raises(ValueError) as error:
        build_dlrm(**{**settings, **kwargs})
    assert message in str(error.value)


def test_table_sizes_expand_and_validate():
    # The model's tables and the batches' keys are TorchRec's names, one per feature the data reads.
    assert (len(DEFAULT_CAT_NAMES), len(DEFAULT_INT_NAMES)) == (NUM_SPARSE, NUM_DENSE) == (26, 13)
    assert expand_table_sizes(7, "x") == [7] * 26
    # Data needs all 26; a benchmark model may have tables for the first features only.
    with pytest.raises(ValueError, match="has 2 sizes; give 26"):
        expand_table_sizes([5, 6], "data.num_embeddings_per_feature")
    assert expand_table_sizes([5, 6], "model.num_embeddings_per_feature", require_all=False) == [5, 6]
    model = build_dlrm(
        interaction="cat", embedding_dim=4, num_embeddings_per_feature=[5, 6],
        dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1],
    )  # fmt: skip
    assert [c.feature_names for c in model.sparse_arch.embedding_bag_collection.embedding_bag_configs()] == [["cat_0"], ["cat_1"]]
    with pytest.raises(ValueError, match=r"data.num_embeddings_per_feature\[3\] = 0 must be a positive integer"):
        expand_table_sizes([5, 5, 5, 0] + [5] * 22, "data.num_embeddings_per_feature")


def test_log_loss_and_normalized_entropy_exact():
    probabilities = torch.tensor([0.9, 0.2, 0.6, 0.1])
    labels = torch.tensor([1, 0, 0, 0])
    expected_log_loss = -(math.log(0.9) + math.log(0.8) + math.log(0.4) + math.log(0.9)) / 4
    base_entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    log_loss, ne = LogLoss(), NormalizedEntropy()
    # two updates must equal one: the states are running sums
    for metric in (log_loss, ne):
        metric.update(probabilities[:1], labels[:1])
        metric.update(probabilities[1:], labels[1:])
    assert log_loss.compute().item() == pytest.approx(expected_log_loss, rel=1e-6)
    assert ne.compute().item() == pytest.approx(expected_log_loss / base_entropy, rel=1e-6)


def test_a_constant_base_rate_prediction_has_normalized_entropy_one():
    labels = torch.tensor([1, 0, 0, 0] * 25)
    ne = NormalizedEntropy()
    ne.update(torch.full((100,), 0.25), labels)
    assert ne.compute().item() == pytest.approx(1.0, rel=1e-6)


def test_multi_hot_rows_become_pooled_bags():
    """Feature j with m_j ids per row becomes one bag per row: lengths m_j, ids in row order."""
    sparse = [np.full((2, 1 + (j % 3)), j, dtype=np.int64) for j in range(26)]
    sparse[1] = np.array([[7, 8], [9, 10]])
    block = RowBlock(dense=np.zeros((2, 13), np.float32), sparse=sparse, labels=np.zeros(2, np.float32))
    features = make_batch(block, np.arange(2)).sparse_features.to_dict()
    assert features["cat_1"].lengths().tolist() == [2, 2]
    assert features["cat_1"].values().tolist() == [7, 8, 9, 10]
    assert features["cat_2"].lengths().tolist() == [3, 3]
    assert features["cat_0"].values().tolist() == [0, 0]



@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_the_click_logit_is_float32_under_bf16_autocast(interaction):
    torch.manual_seed(0)
    model = build_dlrm(
        interaction=interaction, embedding_dim=8, num_embeddings_per_feature=[10] * 26,
        dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[16, 16, 1], dcn_num_layers=1, dcn_low_rank_dim=4,
        interaction_branch1_layer_sizes=[16, 16], interaction_branch2_layer_sizes=[16, 8], embedding_device="cpu",
    )  # fmt: skip
    last = model.over_arch.model[-1]
    assert type(last) is Float32Linear and "over_arch.model.1.weight" in model.state_dict()  # checkpoints unchanged
    inputs: list[torch.Tensor] = []
    last.register_forward_hook(lambda module, args, output: inputs.append(args[0]))
    batch = _batch()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch.dense_features, batch.sparse_features)
    hidden = inputs[0]
    assert hidden.dtype == torch.bfloat16  # the layers before it do run in bf16
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(hidden.float(), last.weight, last.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # what the plain Linear computed: a bf16 logit
        bf16_logits = torch.nn.functional.linear(hidden, last.weight, last.bias)
    assert bf16_logits.dtype == torch.bfloat16 and not torch.equal(logits, bf16_logits.float())


def test_the_float32_logit_layer_keeps_the_parameters_and_the_random_stream():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 1)
    state = torch.random.get_rng_state()
    layer = Float32Linear.from_linear(linear)
    assert torch.equal(torch.random.get_rng_state(), state)  # draws nothing: later weights stay the seed's
    assert layer.weight is linear.weight and layer.bias is linear.bias
    features = torch.randn(3, 4)
    assert torch.equal(layer(features), linear(features))  # float32 without autocast: the same layer


@pytest.mark.parametrize("interaction", INTERACTIONS)
def test_first_order_adds_each_ids_first_embedding_component_to_the_logit(interaction):
    plain = build_dlrm(interaction=interaction, **SMALL_DLRM)
    with_bias = build_dlrm(interaction=interaction, first_order=True, **SMALL_DLRM)
    # The same parameters under the same names: checkpoints move between the two.
    assert list(with_bias.state_dict()) == list(plain.state_dict())
    with_bias.load_state_dict(plain.state_dict())
    batch = _batch()
    tables = plain.sparse_arch.embedding_bag_collection.embedding_bags
    ids = batch.sparse_features.values().view(26, -1)  # one id per feature and row, feature-major
    expected_bias = sum(tables[f"t_cat_{j}"].weight[ids[j], 0] for j in range(26))
    with torch.no_grad():
        difference = with_bias(batch.dense_features, batch.sparse_features) - plain(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(difference.squeeze(1), expected_bias, rtol=0, atol=1e-6)
    assert type(with_bias).__name__.endswith("WithFirstOrder")


@pytest.mark.parametrize("interaction", INTERACTIONS)
@pytest.mark.parametrize("first_order", [False, True])
def test_second_order_adds_the_pairwise_dot_products_of_the_embeddings_to_the_logit(interaction, first_order):
    plain = build_dlrm(interaction=interaction, first_order=first_order, **SMALL_DLRM)
    with_pairs = build_dlrm(interaction=interaction, first_order=first_order, second_order=True, **SMALL_DLRM)
    assert list(with_pairs.state_dict()) == list(plain.state_dict())  # no new parameter
    with_pairs.load_state_dict(plain.state_dict())
    batch = _batch()
    tables = plain.sparse_arch.embedding_bag_collection.embedding_bags
    ids = batch.sparse_features.values().view(26, -1)
    skip = 1 if first_order else 0  # the first component is the bias, not a factor
    rows = [tables[f"t_cat_{j}"].weight[ids[j], skip:] for j in range(26)]  # (B, D - skip) each
    expected = sum((rows[f] * rows[g]).sum(dim=1) for f in range(26) for g in range(f + 1, 26))
    with torch.no_grad():
        difference = with_pairs(batch.dense_features, batch.sparse_features) - plain(batch.dense_features, batch.sparse_features)
    torch.testing.assert_close(difference.squeeze(1), expected, rtol=0, atol=1e-5)
    assert type(with_pairs).__name__.endswith("SecondOrder")


def test_the_factorization_machine_terms_are_float32_under_bf16_autocast():
    model = build_dlrm(interaction="dot", first_order=True, second_order=True, **SMALL_DLRM)
    batch = _batch()
    with torch.no_grad():
        exact = model(batch.dense_features, batch.sparse_features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(batch.dense_features, batch.sparse_features)
    assert autocast.dtype == torch.float32
    # Only the MLPs and the interaction run in bf16: the logits stay within bf16's rounding of their inputs.
    torch.testing.assert_close(autocast, exact, rtol=0, atol=0.05)


def _validation_metrics(cli) -> dict:
    return {"global_step": cli.trainer.global_step} | {
        name: float(value) for name, value in cli.trainer.callback_metrics.items() if name in ("val/logloss", "val/auc")
    }


# The fits below run in float32 whatever the CPU (fit_args: --trainer.precision 32-true, not the default that
# is bf16 autocast on CPUs with bf16 units; bf16 moves projection's AUC by 1.4e-3), but other CPUs' kernels
# round differently and 64 steps carry that into the metrics. Measured on one AVX-512 CPU: ATen's AVX-512,
# AVX2 and default kernels, MKL's CBWR code paths (COMPATIBLE, AVX2, AVX512), oneDNN and FBGEMM capped at
# AVX2, 1 to 8 OpenMP threads, and every dense weight nudged by +-2^-23 at start (6 seeds): cat's metrics
# never moved, projection's took one of two values 2.4e-4 apart in AUC and 1.6e-5 in log loss (also the gap
# between a 2-core AMD EPYC and the CPU these values come from). Nudges 8 and 128 times larger (2^-20,
# 2^-16; 4 seeds each) moved them by at most 6.1e-4 and 9.7e-5. The tolerances cover all of these.
VAL_AUC_ATOL, VAL_LOGLOSS_ATOL = 1e-3, 2e-4


@pytest.mark.parametrize(
    ("interaction", "expected"),
    [
        # Measured on this code (the tests' small model, 2 epochs of 32 steps under seed 0 and the
        # reference tables): a change to what the interaction computes or trains moves them, by more than rounding.
        ("cat", {"global_step": 64, "val/logloss": 0.5437414646148682, "val/auc": 0.6949173212051392}),
        ("projection", {"global_step": 64, "val/logloss": 0.5634496808052063, "val/auc": 0.6632973551750183}),
    ],
)
def test_cat_and_projection_train_through_the_app_to_their_measured_loss_and_auc(interaction, expected, sample_dir, tmp_path):
    sample = {"train": sample_dir / "train.tsv", "val": sample_dir / "val.tsv"}  # 4,096 and 1,024 rows
    args = fit_args(sample, tmp_path, "table_wise", 128) + [
        "--model.interaction", interaction,
        "--model.interaction_branch1_layer_sizes", "[32, 32]", "--model.interaction_branch2_layer_sizes", "[32, 32]",
        "--trainer.precision", "32-true",  # as fit_args sets it: the values above are float32's
    ]  # fmt: skip
    (result,) = run_on_ranks(1, args, tmp_path, _validation_metrics)
    assert result.keys() == expected.keys() and result["global_step"] == expected["global_step"]
    assert result["val/auc"] == pytest.approx(expected["val/auc"], rel=0, abs=VAL_AUC_ATOL)
    assert result["val/logloss"] == pytest.approx(expected["val/logloss"], rel=0, abs=VAL_LOGLOSS_ATOL)
    assert result["val/auc"] > 0.65  # it learned the planted signal (chance: 0.5)
