"""DLRM variants (arXiv 1906.00091) assembled from TorchRec's model parts.

Notation used in shapes:
    B: batch size per rank, F: number of sparse features (26 for Criteo),
    D: embedding dimension, I: number of dense features (13 for Criteo).

TorchRec's ``DLRM`` (dot), ``DLRM_DCN`` (DCNv2) and ``DLRM_Projection`` are used as they are. TorchRec
has no concatenation interaction, the original paper's alternative to the dot product (and the one
Intel Gaudi's reference configuration trains), so ``DLRMConcat`` adds it on top of ``DLRM``.

The click logit (the top MLP's last Linear) is computed in float32 even under autocast
(``trainer.precision: bf16-mixed``): a bf16 logit has 8 significant bits, ~256 values per octave,
which ties predictions in the exact AUC and quantises the log loss (``Float32Linear``).

Example::

    model = build_dlrm(interaction="dot", embedding_dim=16, num_embeddings_per_feature=[1000] * 26,
                       dense_arch_layer_sizes=[64, 16], over_arch_layer_sizes=[64, 1])
    logits = model(dense_features, sparse_features)  # (B, 1)
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import nn
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.models.dlrm import DLRM, DLRM_DCN, DenseArch, DLRM_Projection, OverArch, SparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.types import DataType

from app.criteo import NUM_DENSE

Interaction = Literal["dot", "cat", "dcn", "projection"]
INTERACTIONS: tuple[str, ...] = get_args(Interaction)

# The tables' weights precision: TorchRec gives FBGEMM's TBE the table's data_type as weights_precision
# (torchrec/distributed/batched_embedding_kernel.py, BatchedFusedEmbeddingBag); the pooled output and
# the optimizer state stay float32.
EmbeddingPrecision = Literal["fp32", "fp16"]
EMBEDDING_PRECISIONS: tuple[str, ...] = get_args(EmbeddingPrecision)
_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def table_name(feature_name: str) -> str:
    """The embedding table that serves ``feature_name`` (one table per feature, TorchRec's naming)."""
    return f"t_{feature_name}"


class ConcatInteractionArch(nn.Module):
    """Concatenates the dense embedding and the F pooled sparse embeddings: (B, D), (B, F, D) -> (B, (F + 1) * D);
    embeddings of several widths come already concatenated: (B, D), (B, S) -> (B, D + S)."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if dense_features.dim() != 2 or sparse_features.dim() not in (2, 3):
            raise ValueError(
                f"expected dense (B, D) and sparse (B, F, D) or (B, S), got {tuple(dense_features.shape)} "
                f"and {tuple(sparse_features.shape)}"
            )
        return torch.cat([dense_features, sparse_features.flatten(1)], dim=1)


class ConcatSparseArch(SparseArch):
    """TorchRec's ``SparseArch`` for tables of several widths: the F pooled embeddings side by side, (B, S)
    with S the sum of their widths, in ``sparse_feature_names``' order (SparseArch's (B, F, D) needs one D)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features).to_dict()
        return torch.cat([pooled[name] for name in self.sparse_feature_names], dim=1)


class DLRMConcat(DLRM):
    """DLRM whose interaction concatenates the embeddings instead of taking their dot products.

    Args:
        embedding_bag_collection: the sparse tables (of one dimension D, or of several: their pooled
            embeddings are then concatenated as they are).
        dense_in_features: I, the number of dense features.
        dense_arch_layer_sizes: bottom MLP sizes; the last must equal D.
        over_arch_layer_sizes: top MLP sizes; the last is 1 (the click logit).
        dense_device: device of the dense layers.
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device | None = None,
    ) -> None:
        configs = embedding_bag_collection.embedding_bag_configs()
        if len({config.embedding_dim for config in configs}) > 1:
            self._init_with_several_dims(
                embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
            )
            return
        super().__init__(
            embedding_bag_collection, dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device
        )
        embedding_dim = embedding_bag_collection.embedding_bag_configs()[0].embedding_dim
        num_sparse_features = len(self.sparse_arch.sparse_feature_names)
        self.inter_arch = ConcatInteractionArch()
        self.over_arch = OverArch(
            in_features=(num_sparse_features + 1) * embedding_dim,
            layer_sizes=over_arch_layer_sizes,
            device=dense_device,
        )


    def _init_with_several_dims(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        dense_in_features: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dense_device: torch.device | None,
    ) -> None:
        """DLRM's parts, assembled here: TorchRec's ``DLRM.__init__`` asserts one dim for every table."""
        nn.Module.__init__(self)
        self.sparse_arch = ConcatSparseArch(embedding_bag_collection)
        self.dense_arch = DenseArch(in_features=dense_in_features, layer_sizes=dense_arch_layer_sizes, device=dense_device)
        self.inter_arch = ConcatInteractionArch()
        widths = sum(config.embedding_dim * len(config.feature_names) for config in embedding_bag_collection.embedding_bag_configs())
        self.over_arch = OverArch(
            in_features=dense_arch_layer_sizes[-1] + widths, layer_sizes=over_arch_layer_sizes, device=dense_device
        )


class Float32Linear(nn.Linear):
    """``nn.Linear`` computed in float32 (or wider parameters' dtype) with autocast off: for the click logit.

    Its parameters and state-dict keys are those of the ``nn.Linear`` it replaces (``from_linear``).
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Float32Linear":
        """The same layer (its very parameters, not copies), computed in float32."""
        # skip_init: no initialisation draws from the random generator, so the weights built after
        # this one (and the data order) stay those of the same seed without the swap.
        layer = torch.nn.utils.skip_init(
            cls, linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta"
        )
        layer.weight, layer.bias = linear.weight, linear.bias
        return layer

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(self.weight.dtype, torch.float32)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device_type=features.device.type, enabled=False):
            return nn.functional.linear(features.to(dtype), self.weight.to(dtype), bias)


class FactorizationMachineTerms:
    """Mixin for TorchRec's DLRM classes: the click logit plus a factorization machine's terms over the looked-up
    (pooled) embeddings, computed in float32. Which terms, per class (``with_factorization_machine_terms``):

    * first order: per sparse feature, the embedding's first component -- a learned bias per id. DLRM itself
      has no per-id bias: an id's own effect must pass through dot products with the bottom MLP's output
      or the other embeddings, which it learns slowly and noisily. On Criteo-like data most of the signal
      is such first-order effects (a logistic regression on the ids alone is a strong baseline;
      docs/quality.md). The bias is the embedding's first component rather than a second one-wide table:
      no extra lookup, all-to-all or checkpoint key (FBGEMM's kernels also refuse tables narrower than 4).
    * second order: the sum over pairs of sparse features of their embeddings' dot product (the components
      after the first when the first is the bias), as DeepFM adds an FM beside its MLP (arXiv 1703.04247).
      DLRM's dot interaction computes the same dot products but hands them to the top MLP, which must
      learn to weigh 325 of them before an embedding gets a useful gradient; added straight to the logit,
      a pairwise effect in the data reaches the embeddings from the first step (docs/quality.md). Computed
      as ``((sum_f v_f)^2 - sum_f v_f^2) / 2`` (Rendle's O(F D) identity), no new parameters.

    Same forward as ``DLRM.forward`` otherwise, so TorchRec's pipelines trace it as they trace DLRM.
    """

    first_order_term: bool = False
    second_order_term: bool = False

    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)  # (B, F, D)
        features = self.inter_arch(dense_features=embedded_dense, sparse_features=embedded_sparse)
        logits = self.over_arch(features)
        # float32 at least, as the logit (autocast leaves these element-wise ops in the inputs' dtype).
        embedded = embedded_sparse.to(torch.promote_types(embedded_sparse.dtype, torch.float32))
        if self.first_order_term:
            logits = logits + embedded[:, :, 0].sum(dim=1, keepdim=True)
        if self.second_order_term:
            logits = logits + pairwise_dot_sum(embedded[:, :, 1:] if self.first_order_term else embedded)
        return logits


def pairwise_dot_sum(embedded: torch.Tensor) -> torch.Tensor:
    """(B, F, D) -> (B, 1): the sum over the F (F - 1) / 2 pairs of rows of their dot products."""
    square_of_sum = embedded.sum(dim=1).square()
    sum_of_squares = embedded.square().sum(dim=1)
    return 0.5 * (square_of_sum - sum_of_squares).sum(dim=1, keepdim=True)


_TERM_CLASSES: dict[tuple[type, bool, bool], type] = {}


def with_factorization_machine_terms(model_class: type[DLRM], first_order: bool, second_order: bool) -> type[DLRM]:
    """``model_class`` with :class:`FactorizationMachineTerms`' forward and these terms (one class per DLRM
    variant and terms, made once); ``model_class`` itself without any term."""
    if not (first_order or second_order):
        return model_class
    key = (model_class, first_order, second_order)
    if key not in _TERM_CLASSES:
        terms = "".join(name for name, on in (("FirstOrder", first_order), ("SecondOrder", second_order)) if on)
        attributes = {"first_order_term": first_order, "second_order_term": second_order}
        _TERM_CLASSES[key] = type(f"{model_class.__name__}With{terms}", (FactorizationMachineTerms, model_class), attributes)
    return _TERM_CLASSES[key]


def compute_logit_in_float32(model: DLRM) -> DLRM:
    """Makes the top MLP's last layer (TorchRec's ``OverArch``: an MLP, then one Linear) a ``Float32Linear``."""
    layers = model.over_arch.model
    layers[-1] = Float32Linear.from_linear(layers[-1])
    return model


def check_embedding_precision(precision: str, device_type: str) -> None:
    """Raises a ValueError naming ``model.embedding_precision`` for a precision unknown or unfit for ``device_type``.

    FBGEMM's CPU training kernels run fp16 tables but round every update to the nearest fp16 value:
    they take no ``stochastic_rounding`` (its GPU kernels' default), so an update smaller than half
    the fp16 spacing of the weight is lost (100 SGD steps of 1e-4 leave a weight of 1.0 at 1.0, with
    fbgemm_gpu 1.8.0), and row-wise Adagrad leaves its vectorised fp32 path for a scalar loop.
    """
    if precision not in EMBEDDING_PRECISIONS:
        raise ValueError(f"model.embedding_precision = {precision!r} is not one of {', '.join(EMBEDDING_PRECISIONS)}")
    if precision == "fp16" and device_type == "cpu":
        raise ValueError(
            "model.embedding_precision = fp16: FBGEMM's CPU embedding kernels round fp16 updates to nearest "
            "(no stochastic rounding), so small updates are lost; fp16 tables are for GPUs: use fp32 on CPU"
        )


def build_embedding_bag_collection(
    embedding_dim: int,
    num_embeddings_per_feature: Sequence[int],
    device: torch.device | str = "meta",
    embedding_precision: EmbeddingPrecision = "fp32",
    features: ModelFeatures | None = None,
) -> EmbeddingBagCollection:
    """One sum-pooled table per Criteo categorical feature (the first n features for n sizes), on ``device``,
    its weights in ``embedding_precision`` (fp16: half the memory and lookup bytes, see ``check_embedding_precision``).
    With ``features`` (a data schema's, :func:`check_features`): the tables its categorical features name,
    one size per feature.

    The default "meta" allocates nothing: the strategy's DistributedModelParallel materialises each
    table only on the rank(s) that own its shards.
    """
    if embedding_precision not in EMBEDDING_PRECISIONS:
        raise ValueError(
            f"model.embedding_precision = {embedding_precision!r} is not one of {', '.join(EMBEDDING_PRECISIONS)}"
        )
    if features is not None:
        configs = schema_tables(features, num_embeddings_per_feature, embedding_dim, _DATA_TYPES[embedding_precision])
        return EmbeddingBagCollection(tables=configs, device=torch.device(device))
    if not 1 <= len(num_embeddings_per_feature) <= len(DEFAULT_CAT_NAMES):
        raise ValueError(
            f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} sizes; "
            f"Criteo has {len(DEFAULT_CAT_NAMES)} categorical features"
        )
    tables = [
        EmbeddingBagConfig(
            name=table_name(feature),
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[feature],
            data_type=_DATA_TYPES[embedding_precision],
        )
        for feature, num_embeddings in zip(DEFAULT_CAT_NAMES, num_embeddings_per_feature)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device(device))


# A data schema's features as the model takes them (``model.features``, plain values that checkpoints
# keep): {"dense": [column names], "categorical": [{"name", "table", "dim" (None: model.embedding_dim),
# "pooling" ("sum" or "mean")}, ...]}, in input order. None: Criteo's 13 dense and 26 categorical features.
ModelFeatures = dict[str, Any]
_POOLINGS = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def schema_tables(
    features: ModelFeatures, num_embeddings_per_feature: Sequence[int], embedding_dim: int, data_type: DataType
) -> list[EmbeddingBagConfig]:
    """The tables the categorical features name, in the order each first appears; a table shared by several
    features is one ``EmbeddingBagConfig`` naming them all (TorchRec pools each feature on its own)."""
    categorical = features["categorical"]
    if len(num_embeddings_per_feature) != len(categorical):
        raise ValueError(
            f"num_embeddings_per_feature has {len(num_embeddings_per_feature)} sizes; the data schema has "
            f"{len(categorical)} categorical features"
        )
    tables: dict[str, EmbeddingBagConfig] = {}
    for feature, num_embeddings in zip(categorical, num_embeddings_per_feature):
        config = tables.get(feature["table"])
        if config is None:
            tables[feature["table"]] = EmbeddingBagConfig(
                name=table_name(feature["table"]),
                embedding_dim=feature["dim"] or embedding_dim,
                num_embeddings=num_embeddings,
                feature_names=[feature["name"]],
                pooling=_POOLINGS[feature["pooling"]],
                data_type=data_type,
            )
        elif config.num_embeddings != num_embeddings:
            raise ValueError(
                f"num_embeddings_per_feature gives {config.num_embeddings} rows to {config.feature_names[0]!r} and "
                f"{num_embeddings} to {feature['name']!r}, which share table {feature['table']!r}: give them one size"
            )
        else:
            config.feature_names.append(feature["name"])
    return list(tables.values())


def check_features(features: ModelFeatures | None, interaction: str, embedding_dim: int, fm_terms: bool) -> None:
    """Refuses per-feature dims the interaction cannot take, naming the feature and its dim.

    TorchRec's DLRM (dot), DLRM_DCN and DLRM_Projection stack the pooled embeddings into one (B, F, D)
    tensor and assert one dim for every table; TorchEasyRec's DLRM refuses features of several dims
    ("sparse group feature dims must be the same") rather than project them. So the app does the same:
    a dim other than ``model.embedding_dim`` is refused there, and taken by the ``cat`` interaction,
    which concatenates embeddings of any widths (as TorchEasyRec's concatenating models do), without
    the factorization machine's terms, whose dot products need one dim.
    """
    if features is None:
        return
    for feature in features["categorical"]:
        dim = feature["dim"]
        if dim is None or dim == embedding_dim:
            continue
        where = f"data.schema.categorical {feature['name']!r}: dim = {dim} differs from model.embedding_dim = {embedding_dim}"
        if interaction != "cat":
            raise ValueError(
                f"{where}; model.interaction = {interaction} takes one dim for every table (its dot products): "
                "leave dim out, or use model.interaction: cat"
            )
        if fm_terms:
            raise ValueError(f"{where}; model.first_order and model.second_order take one dim for every table: turn them off")


def build_dlrm_arguments(settings: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``settings`` (e.g. DLRMModule's hyper-parameters) that ``build_dlrm`` takes."""
    accepted = inspect.signature(build_dlrm).parameters
    return {name: value for name, value in settings.items() if name in accepted}


def build_dlrm(
    *,
    interaction: Interaction,
    embedding_dim: int,
    num_embeddings_per_feature: Sequence[int],
    dense_arch_layer_sizes: Sequence[int],
    over_arch_layer_sizes: Sequence[int],
    dcn_num_layers: int = 3,
    dcn_low_rank_dim: int = 512,
    interaction_branch1_layer_sizes: Sequence[int] = (2048, 2048),
    interaction_branch2_layer_sizes: Sequence[int] = (2048, 2048),
    embedding_device: torch.device | str = "meta",
    embedding_precision: EmbeddingPrecision = "fp32",
    first_order: bool = False,
    second_order: bool = False,
    features: ModelFeatures | None = None,
) -> DLRM:
    """Builds a DLRM with the chosen interaction; the embedding tables, in ``embedding_precision``, are left
    on ``embedding_device``. ``first_order`` adds each id's bias to the logit, ``second_order`` the sum of the
    embeddings' pairwise dot products (:class:`FactorizationMachineTerms`). ``features``: a data schema's
    inputs (its dense columns, its tables), else Criteo's 13 dense features and 26 tables.

    Raises:
        ValueError: naming the setting, for an unknown interaction or inconsistent layer sizes.
    """
    validate_dlrm_sizes(interaction, embedding_dim, dense_arch_layer_sizes, over_arch_layer_sizes)
    check_features(features, interaction, embedding_dim, first_order or second_order)
    common = dict(
        embedding_bag_collection=build_embedding_bag_collection(
            embedding_dim, num_embeddings_per_feature, embedding_device, embedding_precision, features
        ),
        dense_in_features=NUM_DENSE if features is None else len(features["dense"]),
        dense_arch_layer_sizes=list(dense_arch_layer_sizes),
        over_arch_layer_sizes=list(over_arch_layer_sizes),
    )
    def variant(model_class: type[DLRM]) -> type[DLRM]:
        return with_factorization_machine_terms(model_class, first_order, second_order)

    if interaction == "dot":
        return compute_logit_in_float32(variant(DLRM)(**common))
    if interaction == "cat":
        return compute_logit_in_float32(variant(DLRMConcat)(**common))
    if interaction == "dcn":
        return compute_logit_in_float32(
            variant(DLRM_DCN)(**common, dcn_num_layers=dcn_num_layers, dcn_low_rank_dim=dcn_low_rank_dim)
        )
    for name, sizes in (
        ("interaction_branch1_layer_sizes", interaction_branch1_layer_sizes),
        ("interaction_branch2_layer_sizes", interaction_branch2_layer_sizes),
    ):
        if sizes[-1] % embedding_dim:
            raise ValueError(f"model.{name}[-1] = {sizes[-1]} must be a multiple of embedding_dim = {embedding_dim}")
    return compute_logit_in_float32(
        variant(DLRM_Projection)(
            **common,
            interaction_branch1_layer_sizes=list(interaction_branch1_layer_sizes),
            interaction_branch2_layer_sizes=list(interaction_branch2_layer_sizes),
        )
    )


def validate_dlrm_sizes(
    interaction: str,
    embedding_dim: int,
    dense_arch_layer_sizes: Sequence[int],
    over_arch_layer_sizes: Sequence[int],
) -> None:
    """Checks the settings TorchRec would otherwise reject with a bare assertion deep in construction."""
    if interaction not in INTERACTIONS:
        raise ValueError(f"model.interaction = {interaction!r} is not one of {', '.join(INTERACTIONS)}")
    if embedding_dim < 1:
        raise ValueError(f"model.embedding_dim = {embedding_dim} must be positive")
    if not dense_arch_layer_sizes or dense_arch_layer_sizes[-1] != embedding_dim:
        raise ValueError(
            f"model.dense_arch_layer_sizes = {list(dense_arch_layer_sizes)} must end with embedding_dim = {embedding_dim}: "
            "the bottom MLP's output meets the embeddings in the interaction"
        )
    if len(over_arch_layer_sizes) < 2 or over_arch_layer_sizes[-1] != 1:
        raise ValueError(
            f"model.over_arch_layer_sizes = {list(over_arch_layer_sizes)} needs at least two layers and must end with 1 "
            "(the click logit)"
        )
