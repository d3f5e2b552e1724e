"""The serving graph of ``python -m app export --format pt2``: the whole model in plain torch ops, from raw
log values to click probabilities, ready for ``torch.export``.

What the graph does, matching the data road and the model exactly:

* dense: each raw value becomes the model's feature as its reader made it (``log(max(x, 0) + 1)`` for
  Criteo's counts, ``log(max(x, -2) + 3)``, a schema's ``standardize`` with the training rows' mean
  and std, or the value itself for ``transform: none``),
  computed in float64 and rounded once to float32, as the readers do (app/data/tsv_decode.py,
  app/data/parquet/reader.py);
* ids: the raw integer ids (the hex id's value, a missing one sent as 0) are mapped as training mapped
  them: hashed, ``id mod table size``; or, with ``data.frequency_threshold``, by a binary search in the
  sorted vocabulary (``torch.searchsorted``): a kept id to its position + 2, any other to 1 (the
  out-of-vocabulary row), then ``mod table size`` (app/data/preprocess/vocabulary.py);
* lookups: one ``embedding`` gather per group of tables of one width stacked into one weight (row
  offsets per feature; features may share a table), no FBGEMM or TorchRec; INT8 tables are stored
  row-wise (uint8 codes, a per-row fp16 scale and uint8 zero point) and dequantised in the graph after
  the gather;
* the dense, interaction and top parts are the trained model's own modules (TorchRec's are plain torch),
  and the factorization machine's terms are added as ``FactorizationMachineTerms`` adds them.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from app.data.preprocess import FIRST_CONTIGUOUS_ID
from app.data.preprocess import RARE_ID as OUT_OF_VOCABULARY_ID  # the data road's mapping, exactly
from app.model.dlrm import Float32Linear, pairwise_dot_sum

# Per row, row-wise INT8 stores D one-byte codes, an fp16 scale and a one-byte zero point: D + 3 bytes where
# float32 stores 4 D, so a table of R rows saves R (3 D - 3) bytes. The tables of one width are stacked into one
# weight and dequantised by one gather of codes, scales and zero points and a multiply, whatever their number:
# that code is what quantising them adds to the package, at most about 4 KiB of compiled library (measured on
# the demo recipe: 4,136 bytes more beside a float32 group of another width's tables, 40 where it replaced the
# only float32 gather). So a width's tables are quantised together when they save more than that, and are too
# small to quantise usefully otherwise (or at D = 1: no saving).
INT8_ROW_EXTRA_BYTES = 3
DEQUANTIZATION_CODE_BYTES = 4096


def int8_saving_bytes(rows: int, width: int) -> int:
    """Bytes a table of ``rows`` x ``width`` saves stored row-wise INT8 instead of float32."""
    return rows * (4 * width - (width + INT8_ROW_EXTRA_BYTES))


@dataclass(frozen=True)
class RowWiseInt8:
    """A table quantised row by row: ``row ~= (codes - zero_point) * scale``, 256 levels per row.

    Per row an fp16 scale and a one-byte zero point (the row's bias, in steps): ``D + 3`` bytes for a row of
    ``4 D`` in float32, 0.297 of it at ``D = 16`` (an fp16 bias would make it ``D + 4``, 0.31). The levels
    span the row's values and 0, so 0 stays exact.
    """

    codes: torch.Tensor  # (rows, D) uint8
    scale: torch.Tensor  # (rows, 1) float16
    zero_point: torch.Tensor  # (rows, 1) uint8

    @classmethod
    def of(cls, weight: torch.Tensor) -> "RowWiseInt8":
        """Quantises ``weight`` (rows, D). The scale is rounded to fp16 first and the codes chosen against the
        rounded value, so the error left is the codes' rounding: half a step, at most 0.62 of one at the row's
        maximum where fp16 rounded the scale down (the top code then clips)."""
        weight = weight.float()
        low = weight.min(dim=1, keepdim=True).values.clamp_max(0.0)
        high = weight.max(dim=1, keepdim=True).values.clamp_min(0.0)
        scale = ((high - low) / 255.0).to(torch.float16)
        step = scale.float().clamp_min(torch.finfo(torch.float16).tiny)  # an all-zero row has scale 0
        zero_point = torch.round(-low / step).clamp_(0, 255)
        codes = torch.round(weight / step + zero_point).clamp_(0, 255).to(torch.uint8)
        return cls(codes, scale, zero_point.to(torch.uint8))

    def dequantized(self) -> torch.Tensor:
        return (self.codes.float() - self.zero_point.float()) * self.scale.float()


class IdMapping(nn.Module):
    """Raw ids (B, F) -> table rows (B, F): hashed (``vocabularies`` None) or through the vocabulary."""

    def __init__(self, table_sizes: Sequence[int], vocabularies: Sequence[torch.Tensor] | None) -> None:
        super().__init__()
        self.register_buffer("table_sizes", torch.tensor(list(table_sizes), dtype=torch.int64), persistent=False)
        self.kind = "hash" if vocabularies is None else "vocabulary"
        self.num_vocabularies = 0 if vocabularies is None else len(vocabularies)
        self.vocabulary_sizes = [] if vocabularies is None else [int(v.numel()) for v in vocabularies]
        for j, vocabulary in enumerate(vocabularies or ()):
            self.register_buffer(f"vocabulary_{j}", vocabulary.to(torch.int64).contiguous(), persistent=False)

    def forward(self, raw_ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "hash":
            return torch.remainder(raw_ids, self.table_sizes)
        columns = [self._contiguous(raw_ids[:, j].contiguous(), j) for j in range(self.num_vocabularies)]
        return torch.remainder(torch.stack(columns, dim=1), self.table_sizes)

    def _contiguous(self, column: torch.Tensor, j: int) -> torch.Tensor:
        """One feature's raw ids -> position + 2 when in its vocabulary, else 1 (map_to_contiguous's rule)."""
        size = self.vocabulary_sizes[j]
        if size == 0:  # every id of this feature was rare in training
            return torch.full_like(column, OUT_OF_VOCABULARY_ID)
        vocabulary = getattr(self, f"vocabulary_{j}")
        position = torch.searchsorted(vocabulary, column).clamp_max(size - 1)
        found = vocabulary[position] == column
        return torch.where(found, position + FIRST_CONTIGUOUS_ID, torch.full_like(column, OUT_OF_VOCABULARY_ID))


class StackedTables(nn.Module):
    """The tables grouped by width and kind (float32 or INT8), each group stacked into one weight: a lookup
    gathers a group's rows at once, then the features are put in the model's order -> (B, F, D), or with
    tables of several widths (the ``cat`` interaction's) their embeddings side by side -> (B, sum of widths).

    ``feature_tables[j]``: the table of input feature j (features may share a table). The model's order is
    TorchRec's ``SparseArch``'s: table by table, each table's features in input order (the input order
    itself where every feature has its own table)."""

    def __init__(self, tables: Sequence[torch.Tensor | RowWiseInt8], feature_tables: Sequence[int]) -> None:
        super().__init__()
        kinds = [(int(_codes(t).shape[1]), isinstance(t, RowWiseInt8)) for t in tables]
        self.groups: list[tuple[bool, list[int]]] = []  # per group: INT8 or not, its features in order
        for kind in sorted(set(kinds)):
            members = [t for t in range(len(tables)) if kinds[t] == kind]
            offsets = dict(zip(members, self._offsets([_codes(tables[t]).shape[0] for t in members])))
            features = [j for j, t in enumerate(feature_tables) if kinds[t] == kind]
            g = len(self.groups)
            self.groups.append((kind[1], features))
            self.register_buffer(f"offsets_{g}", torch.tensor([offsets[feature_tables[j]] for j in features]), persistent=False)
            if kind[1]:
                for part in ("codes", "scale", "zero_point"):
                    stacked = torch.cat([getattr(tables[t], part) for t in members])
                    self.register_buffer(f"{part}_{g}", stacked, persistent=False)
            else:
                self.register_buffer(f"weight_{g}", torch.cat([tables[t].float() for t in members]), persistent=False)
        order = [j for _, features in self.groups for j in features]  # features as the gathers return them
        model_order = sorted(range(len(feature_tables)), key=lambda j: feature_tables[j])
        self.feature_order = [order.index(j) for j in model_order]
        self.one_width = len({kind[0] for kind in kinds}) == 1

    @staticmethod
    def _offsets(rows: list[int]) -> list[int]:
        return [sum(rows[:j]) for j in range(len(rows))]

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        parts = []
        for g, (int8, features) in enumerate(self.groups):
            index = rows[:, features] + getattr(self, f"offsets_{g}")
            if not int8:
                parts.append(nn.functional.embedding(index, getattr(self, f"weight_{g}")))
                continue
            codes = nn.functional.embedding(index, getattr(self, f"codes_{g}")).float()
            scale = nn.functional.embedding(index, getattr(self, f"scale_{g}")).float()
            zero_point = nn.functional.embedding(index, getattr(self, f"zero_point_{g}")).float()
            parts.append((codes - zero_point) * scale)
        if self.one_width:
            pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            return pooled if self.feature_order == list(range(len(self.feature_order))) else pooled[:, self.feature_order]
        by_feature = [column for part in parts for column in part.unbind(dim=1)]  # several widths: (B, D_j) each
        return torch.cat([by_feature[k] for k in self.feature_order], dim=1)


def _codes(table: torch.Tensor | RowWiseInt8) -> torch.Tensor:
    return table.codes if isinstance(table, RowWiseInt8) else table


# How a dense input becomes the model's float32 feature, in float64 then rounded once, as the readers do
# (app/data/tsv_decode.py, app/data/parquet/reader.py).
DENSE_TRANSFORMS = ("log1p", "log_plus_3", "none", "standardize")


class ServingDLRM(nn.Module):
    """(dense inputs (B, I), raw ids (B, C) int64) -> click probabilities (B,) float32.

    ``dense_transforms``: one of DENSE_TRANSFORMS per dense input; ``dense_statistics``: the training
    rows' (mean, std) per dense input, for ``standardize`` (the others' are not read). The model may take more inputs than the
    data gave (a data schema's model of Criteo's shape): the rest are the constants the reader fills in,
    dense 0 and raw id 0; of more ids than it has tables, it takes the first.
    """

    def __init__(
        self,
        trained: nn.Module,
        tables: Sequence[torch.Tensor | RowWiseInt8],
        feature_tables: Sequence[int],
        id_mapping: IdMapping,
        first_order: bool,
        second_order: bool,
        dense_transforms: Sequence[str],
        model_dense_inputs: int,
        dense_statistics: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        super().__init__()
        self.dense_arch = copy.deepcopy(trained.dense_arch)
        self.inter_arch = copy.deepcopy(trained.inter_arch)
        self.over_arch = copy.deepcopy(trained.over_arch)
        layers = self.over_arch.model
        if isinstance(layers[-1], Float32Linear):  # float32 already here: a plain Linear, no autocast region
            last = nn.Linear(layers[-1].in_features, layers[-1].out_features, bias=layers[-1].bias is not None)
            last.weight, last.bias = layers[-1].weight, layers[-1].bias
            layers[-1] = last
        self.id_mapping = id_mapping
        self.tables = StackedTables(tables, feature_tables)
        self.num_features = len(feature_tables)
        self.first_order, self.second_order = first_order, second_order
        self.transforms = set(dense_transforms)
        for name in DENSE_TRANSFORMS:
            mask = torch.tensor([t == name for t in dense_transforms], dtype=torch.bool)
            self.register_buffer(f"{name}_columns", mask, persistent=False)
        self.dense_padding = model_dense_inputs - len(dense_transforms)
        statistics = torch.tensor(list(dense_statistics or [(0.0, 1.0)] * len(dense_transforms)), dtype=torch.float64)
        self.register_buffer("mean", statistics.reshape(-1, 2)[:, 0].contiguous(), persistent=False)
        self.register_buffer("std", statistics.reshape(-1, 2)[:, 1].contiguous(), persistent=False)

    def dense_features(self, dense: torch.Tensor) -> torch.Tensor:
        """The dense inputs transformed as the reader transforms them, then the constant 0 of the inputs
        no column filled."""
        values = dense.to(torch.float64)
        transformed = {
            "log1p": lambda: torch.log1p(values.clamp_min(0.0)),
            "log_plus_3": lambda: torch.log(values.clamp_min(-2.0) + 3.0),
            "none": lambda: values,
            "standardize": lambda: (values - self.mean) / self.std,  # as the reader: float64, then float32
        }
        if len(self.transforms) == 1:  # one transform for every column (Criteo's): no selection
            features = transformed[next(iter(self.transforms))]()
        else:
            features = values
            for name in sorted(self.transforms - {"none"}):
                features = torch.where(getattr(self, f"{name}_columns"), transformed[name](), features)
        features = features.to(torch.float32)
        if self.dense_padding:
            features = torch.cat([features, features.new_zeros(features.shape[0], self.dense_padding)], dim=1)
        return features

    def raw_ids(self, sparse: torch.Tensor) -> torch.Tensor:
        """The ids of the model's features: the first ones given, then raw id 0 for those no column filled."""
        given = sparse[:, : self.num_features]
        missing = self.num_features - given.shape[1]
        return given if missing <= 0 else torch.cat([given, given.new_zeros(given.shape[0], missing)], dim=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        rows = self.id_mapping(self.raw_ids(sparse))
        embedded = self.tables(rows)  # (B, F, D), or (B, sum of widths) for tables of several widths
        features = self.inter_arch(dense_features=self.dense_arch(self.dense_features(dense)), sparse_features=embedded)
        logits = self.over_arch(features)
        if self.first_order:
            logits = logits + embedded[:, :, 0].sum(dim=1, keepdim=True)
        if self.second_order:
            logits = logits + pairwise_dot_sum(embedded[:, :, 1:] if self.first_order else embedded)
        return torch.sigmoid(logits.squeeze(-1))
