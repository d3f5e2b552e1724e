"""The serving graph of ``python -m app export --format pt2``: the whole model in plain torch ops, from raw
log values to click probabilities, ready for ``torch.export``.

What the graph does, matching the data road and the model exactly:

* dense: the 13 raw integer counts (int64, a missing value sent as 0) become ``log(max(x, 0) + 1)``,
  computed in float64 and rounded once to float32, as the TSV decoder does (app/data/tsv_decode.py);
* ids: the 26 raw integer ids (the hex id's value, a missing one sent as 0) are mapped as training mapped
  them: hashed, ``id mod table size``; or, with ``data.frequency_threshold``, by a binary search in the
  sorted vocabulary (``torch.searchsorted``): a kept id to its position + 2, any other to 1 (the
  out-of-vocabulary row), then ``mod table size`` (app/data/preprocess/vocabulary.py);
* lookups: one ``embedding`` gather over the tables stacked into one weight (row offsets per feature), no
  FBGEMM or TorchRec; INT8 tables are stored row-wise (uint8 codes, a per-row fp16 scale and uint8 zero
  point) and dequantised in the graph after the gather;
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
# A table with fewer rows stays float32 in an INT8 export: at most 256 x D x 4 bytes (64 KiB at D = 64),
# little beside the compiled code (0.5 to 0.8 MB), and such a table's rows are each looked up often, so
# keeping them exact costs no size worth saving.
MIN_QUANTIZED_ROWS = 256


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
    """The F tables as one float32 weight and one INT8 weight (either may hold no table): lookups gather
    each group's rows at once, then put the features back in their order -> (B, F, D)."""

    def __init__(self, tables: Sequence[torch.Tensor | RowWiseInt8]) -> None:
        super().__init__()
        dense_group = [j for j, t in enumerate(tables) if not isinstance(t, RowWiseInt8)]
        int8_group = [j for j, t in enumerate(tables) if isinstance(t, RowWiseInt8)]
        self.groups = (dense_group, int8_group)
        order = dense_group + int8_group  # features as the two gathers return them
        self.register_buffer("feature_order", torch.tensor([order.index(j) for j in range(len(tables))]), persistent=False)
        self.register_buffer("float_offsets", self._offsets([tables[j].shape[0] for j in dense_group]), persistent=False)
        self.register_buffer("int8_offsets", self._offsets([tables[j].codes.shape[0] for j in int8_group]), persistent=False)
        if dense_group:
            self.register_buffer("float_weight", torch.cat([tables[j].float() for j in dense_group]), persistent=False)
        if int8_group:
            self.register_buffer("int8_codes", torch.cat([tables[j].codes for j in int8_group]), persistent=False)
            self.register_buffer("int8_scale", torch.cat([tables[j].scale for j in int8_group]), persistent=False)
            self.register_buffer("int8_zero_point", torch.cat([tables[j].zero_point for j in int8_group]), persistent=False)

    @staticmethod
    def _offsets(rows: list[int]) -> torch.Tensor:
        return torch.tensor([sum(rows[:j]) for j in range(len(rows))], dtype=torch.int64)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        dense_group, int8_group = self.groups
        parts = []
        if dense_group:
            parts.append(nn.functional.embedding(rows[:, dense_group] + self.float_offsets, self.float_weight))
        if int8_group:
            index = rows[:, int8_group] + self.int8_offsets
            codes = nn.functional.embedding(index, self.int8_codes).float()
            scale = nn.functional.embedding(index, self.int8_scale).float()
            zero_point = nn.functional.embedding(index, self.int8_zero_point).float()
            parts.append((codes - zero_point) * scale)
        pooled = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return pooled if not (dense_group and int8_group) else pooled[:, self.feature_order]


class ServingDLRM(nn.Module):
    """(dense counts (B, 13) int64, raw ids (B, 26) int64) -> click probabilities (B,) float32."""

    def __init__(
        self,
        trained: nn.Module,
        tables: Sequence[torch.Tensor | RowWiseInt8],
        id_mapping: IdMapping,
        first_order: bool,
        second_order: bool,
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
        self.tables = StackedTables(tables)
        self.num_features = len(tables)
        self.first_order, self.second_order = first_order, second_order

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        dense_features = torch.log1p(dense.clamp_min(0).to(torch.float64)).to(torch.float32)
        rows = self.id_mapping(sparse[:, : self.num_features])
        embedded = self.tables(rows)  # (B, F, D)
        features = self.inter_arch(dense_features=self.dense_arch(dense_features), sparse_features=embedded)
        logits = self.over_arch(features)
        if self.first_order:
            logits = logits + embedded[:, :, 0].sum(dim=1, keepdim=True)
        if self.second_order:
            logits = logits + pairwise_dot_sum(embedded[:, :, 1:] if self.first_order else embedded)
        return torch.sigmoid(logits.squeeze(-1))
