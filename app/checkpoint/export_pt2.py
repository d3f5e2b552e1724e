"""``python -m app export --format pt2 [--quantize int8]``: one AOTInductor package a server loads with torch
alone, and its serving contract beside it.

The package (``torch._inductor.aoti_compile_and_package``) holds the whole model compiled for this
machine's device (CPU here; CUDA where the export runs on a GPU), with the raw-id mapping it was trained
with (app/checkpoint/serving_graph.py). It takes two inputs with a dynamic batch dimension (the dense
values and the raw ids, as the data the model was trained on names them) and returns click
probabilities; ``torch._inductor.aoti_load_package`` loads it in Python and
``torch::inductor::AOTIModelPackageLoader`` in C++. A CPU package is then rewritten smaller
(app/checkpoint/package_size.py). The contract, ``<package stem>.contract.json``, says what the inputs
are (names, dtypes, shapes, feature order), how ids are mapped, which versions made the package and its
CRC-32; app/checkpoint/serving_runtime.py checks both against it (docs/serving.md).

Example::

    python -m app export --format pt2 --ckpt_path runs/demo/checkpoints/last.ckpt --output model.pt2
    python -m app export --format pt2 --quantize int8 --ckpt_path model.pt --output model-int8.pt2
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from app.checkpoint.export import read_model_tensors
from app.checkpoint.package_size import slim_package
from app.checkpoint.saved_model import read_saved_model
from app.checkpoint.serving_graph import (
    DENSE_TRANSFORMS, DEQUANTIZATION_CODE_BYTES, IdMapping, RowWiseInt8, ServingDLRM, int8_saving_bytes,
)  # fmt: skip
from app.checkpoint.serving_runtime import CONTRACT_FORMAT, DENSE_INPUT, DENSE_VALUES_INPUT, SPARSE_INPUT, contract_path, file_crc32
from app.criteo import NUM_DENSE, SPARSE_NAMES
from app.data.parquet.statistics import STATISTICS_KEY as DENSE_STATISTICS_KEY
from app.model.dlrm import build_dlrm, build_dlrm_arguments, table_name

LOWERED_INTERACTIONS = ("dot", "cat", "dcn", "projection")
QUANTIZE_CHOICES = ("none", "int8")
# The batch dimension's range: 1 row (one request) up to what one call may score.
MAX_BATCH_ROWS = 65_536
# No line tables (-g1) in the compiled code: they are about 1.4 MB of every package (more than the demo's
# tables) and serve only a debugger; AOT_INDUCTOR_DEBUG_SYMBOLS=1 still adds full symbols when wanted. The
# wrapper (AOTInductor's runtime and the call sequence; the kernels stay -O3) compiled for size: 48 KB less
# library, 16 KB deflated, with the same probabilities and no 1-row latency change measurable on 2 cores.
COMPILE_SETTINGS = {"aot_inductor.enable_line_tables": False, "aot_inductor.compile_wrapper_opt_level": "Os"}
_TABLE_PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags."


@dataclass(frozen=True)
class SavedWeights:
    """What a checkpoint folder or an exported model file holds for serving."""

    hyper_parameters: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    vocabulary_ids: list[torch.Tensor] | None  # one sorted int64 tensor per feature, or None for hashed ids
    frequency_threshold: int
    data_layout: dict[str, Any]  # the features it was trained on and how each was made (app/data/layout.py)
    dense_statistics: dict[str, list[float]]  # standardize's training [mean, std] per column ({} without)


def read_saved_weights(source: Path) -> SavedWeights:
    """The model's settings, tensors and vocabulary from a checkpoint folder or a ``python -m app export`` file."""
    saved = read_saved_model(source)  # either kind, checked; a ValueError naming the path if neither
    if saved.info is None:  # an exported file
        state_dict = torch.load(source, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
    else:
        state_dict = read_model_tensors(saved.info.path)
    hyper_parameters, data_state = saved.hyper_parameters, saved.data_state
    threshold = int(data_state.get("frequency_threshold", 0))
    vocabulary = data_state.get("vocabulary") if threshold else None
    ids = None
    if vocabulary is not None:
        arrays = vocabulary.ids if hasattr(vocabulary, "ids") else vocabulary["ids"]
        ids = [torch.tensor(np.asarray(array), dtype=torch.int64) for array in arrays]  # a copy: the files are read-only maps
    statistics = dict(data_state.get(DENSE_STATISTICS_KEY) or {})
    return SavedWeights(dict(hyper_parameters), state_dict, ids, threshold, saved.data_layout, statistics)


def check_lowerable(
    hyper_parameters: dict[str, Any], source: Path, layout: dict[str, Any] | None = None, statistics: dict[str, Any] | None = None
) -> None:
    """Refuses, naming the setting or the feature, a model the serving graph does not reproduce; before any
    compile."""
    interaction = hyper_parameters.get("interaction", "dot")
    if interaction not in LOWERED_INTERACTIONS:
        raise ValueError(
            f"ckpt_path {source}: model.interaction = {interaction!r} has no plain-torch serving graph "
            f"(the pt2 export lowers {', '.join(LOWERED_INTERACTIONS)})"
        )
    problems = [] if layout is None else unlowered_features(layout, statistics or {})
    if problems:
        more = f" (and {len(problems) - 1} more: {', '.join(name for name, _ in problems[1:])})" if len(problems) > 1 else ""
        name, why = problems[0]
        raise ValueError(f"ckpt_path {source} has no pt2 serving graph: feature {name!r} {why}{more}")


def unlowered_features(layout: dict[str, Any], statistics: dict[str, Any]) -> list[tuple[str, str]]:
    """(feature, why) for each input of the training data the serving graph does not make as its reader made it."""
    problems = []
    for column in layout["dense"]:
        transform = column.get("transform")
        if transform == "standardize" and column["name"] not in statistics:
            problems.append((column["name"], "is standardised, but the checkpoint holds no mean and std for it"))
        elif transform is None:
            problems.append((column["name"], "comes from NumPy days that do not record their dense transform (no metadata.json)"))
        elif transform not in DENSE_TRANSFORMS:
            problems.append((column["name"], f"has transform {transform!r}; the graph applies {', '.join(DENSE_TRANSFORMS)}"))
    for column in layout["categorical"]:
        problems += [(column["name"], why) for why in [_unlowered_ids(column, layout["format"])] if why]
    return problems


def _unlowered_ids(column: dict[str, Any], format: str) -> str | None:
    """Why the graph cannot take this categorical feature's ids as the server has them (None: it can)."""
    if format == "multi_hot":
        return "comes from multi-hot days (several ids per row); the graph takes one id per feature and row"
    if column.get("max_length"):
        return (f"is a list column (max_length {column['max_length']}); the graph takes one id per feature and row, "
                "not a list of ids and their pooled lookup")  # fmt: skip
    ids = column.get("ids")
    if ids == "string":
        return ("has string ids, which the reader hashes (64-bit FNV-1a folded to 32 bits); the package takes integer "
                "ids, so a server would have to hash each string that way before it, and the graph does not hash strings")  # fmt: skip
    if ids == "contiguous":
        return "comes from NumPy days whose ids a preprocessor's vocabulary mapped; the checkpoint does not hold that vocabulary"
    if ids not in ("hex", "integer"):
        return "comes from NumPy days that do not record how their ids were made (no metadata.json)"
    return None


@dataclass(frozen=True)
class ServingInputs:
    """The package's two inputs, as the training data's layout names them."""

    dense_name: str  # dense_counts (Criteo's integer counts, int64) or dense_values (a schema's columns, float64)
    dense_dtype: torch.dtype
    dense_features: list[str]
    dense_transforms: list[str]
    dense_fills: list[float | None]
    dense_statistics: list[tuple[float, float] | None]  # standardize's training (mean, std); None for others
    id_features: list[str]
    id_kinds: list[str]

    @classmethod
    def of(cls, layout: dict[str, Any], statistics: dict[str, Any]) -> "ServingInputs":
        dense, categorical = layout["dense"], layout["categorical"]
        counts = layout["format"] != "parquet"  # Criteo's integer counts; a schema's columns may be fractional
        moments = [tuple(statistics[c["name"]]) if c["transform"] == "standardize" else None for c in dense]
        return cls(
            DENSE_INPUT if counts else DENSE_VALUES_INPUT, torch.int64 if counts else torch.float64,
            [c["name"] for c in dense], [c["transform"] for c in dense], [c.get("fill") for c in dense], moments,
            [c["name"] for c in categorical], [c.get("ids") or "hex" for c in categorical],
        )  # fmt: skip


def model_tables(saved: SavedWeights) -> tuple[list[str], list[str], list[int]]:
    """The model's tables in order (their names as the data names them, and their state-dict keys) and each
    feature's table: a schema's (``model.features``: tables in the order features first name them,
    possibly shared), else Criteo's C1.., one each, as many as the checkpoint holds."""
    features = saved.hyper_parameters.get("features")
    if features:
        names: list[str] = []
        for feature in features["categorical"]:
            if (feature.get("table") or feature["name"]) not in names:
                names.append(feature.get("table") or feature["name"])
        feature_tables = [names.index(f.get("table") or f["name"]) for f in features["categorical"]]
        return names, [_weight_key(name) for name in names], feature_tables
    keys = [_weight_key(feature) for feature in DEFAULT_CAT_NAMES]  # C1..C26 in the model's names
    count = next((j for j, key in enumerate(keys) if key not in saved.state_dict), len(keys))
    return list(SPARSE_NAMES[:count]), keys[:count], list(range(count))


def _weight_key(table: str) -> str:
    return f"{_TABLE_PREFIX}{table_name(table)}.weight"


def serving_tables(saved: SavedWeights, quantize: str, report=print) -> list[torch.Tensor | RowWiseInt8]:
    """The tables in the model's order, row-wise INT8 where ``quantize`` asks and their width's tables together
    save more bytes than the code that dequantises them (serving_graph.DEQUANTIZATION_CODE_BYTES)."""
    names, keys, _ = model_tables(saved)
    tables = [saved.state_dict[key] for key in keys]
    if quantize != "int8":
        return tables
    kept_widths = set()
    for width in sorted({int(weight.shape[1]) for weight in tables}):
        members = [j for j, weight in enumerate(tables) if weight.shape[1] == width]
        rows = sum(int(tables[j].shape[0]) for j in members)
        if int8_saving_bytes(rows, width) <= DEQUANTIZATION_CODE_BYTES:
            kept_widths.add(width)
            report(
                f"int8: {len(members)} table(s) of width {width} stay float32, too small to quantise usefully: their "
                f"{rows:,} rows would save {int8_saving_bytes(rows, width):,} bytes, no more than the "
                f"{DEQUANTIZATION_CODE_BYTES:,} bytes of compiled code that dequantises them: {', '.join(names[j] for j in members)}"
            )
    return [weight if weight.shape[1] in kept_widths else RowWiseInt8.of(weight) for weight in tables]


def constant_bytes(module: ServingDLRM) -> dict[str, int]:
    """The bytes of the package's constants by what they are (uncompressed, as the library holds them): the
    tables as stored and as float32 would store them, the vocabulary, the dense layers and the rest."""
    counted = {"tables": 0, "tables_float32": 0, "vocabulary": 0, "dense_layers": 0, "other": 0}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        size = tensor.numel() * tensor.element_size()
        part = name.split(".")[-1]
        if name.startswith("tables.") and not part.startswith("offsets_"):
            counted["tables"] += size
            if part.startswith(("weight_", "codes_")):
                counted["tables_float32"] += tensor.numel() * 4
        elif name.startswith("id_mapping.vocabulary_"):
            counted["vocabulary"] += size
        elif isinstance(tensor, nn.Parameter):
            counted["dense_layers"] += size
        else:
            counted["other"] += size
    return counted


def build_serving_module(saved: SavedWeights, quantize: str, source: Path, report=print) -> ServingDLRM:
    """The plain-torch serving module of a saved model (the trained dense parts, the tables, the id mapping,
    the dense transforms of its data); its ``inputs`` say what the package takes."""
    check_lowerable(saved.hyper_parameters, source, saved.data_layout, saved.dense_statistics)
    tables = serving_tables(saved, quantize, report)
    if not tables:
        raise ValueError(f"ckpt_path {source} holds no embedding table under {_TABLE_PREFIX}")
    _, _, feature_tables = model_tables(saved)
    sizes = [int((t.codes if isinstance(t, RowWiseInt8) else t).shape[0]) for t in (tables[k] for k in feature_tables)]
    settings = dict(build_dlrm_arguments(saved.hyper_parameters), num_embeddings_per_feature=sizes, embedding_device="meta")
    trained = build_dlrm(**settings)
    for part in ("dense_arch", "inter_arch", "over_arch"):
        prefix = f"model.{part}."
        state = {k[len(prefix) :]: v for k, v in saved.state_dict.items() if k.startswith(prefix)}
        getattr(trained, part).load_state_dict(state)
    inputs = ServingInputs.of(saved.data_layout, saved.dense_statistics)
    model_dense = len((saved.hyper_parameters.get("features") or {}).get("dense", [None] * NUM_DENSE))
    if len(inputs.dense_features) > model_dense:
        raise ValueError(f"ckpt_path {source}: its data has {len(inputs.dense_features)} dense features, its model takes {model_dense}")
    vocabularies = saved.vocabulary_ids[: len(sizes)] if saved.vocabulary_ids is not None else None
    hp = saved.hyper_parameters
    module = ServingDLRM(trained, tables, feature_tables, IdMapping(sizes, vocabularies), bool(hp.get("first_order")),
                         bool(hp.get("second_order")), inputs.dense_transforms, model_dense,
                         [m or (0.0, 1.0) for m in inputs.dense_statistics])  # fmt: skip
    module.inputs = inputs
    return module.eval()


def example_inputs(inputs: ServingInputs, rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randint(0, 1000, (rows, len(inputs.dense_features)), generator=generator, dtype=torch.int64)
    sparse = torch.randint(0, 2**32, (rows, len(inputs.id_features)), generator=generator, dtype=torch.int64)
    return dense.to(inputs.dense_dtype).to(device), sparse.to(device)


def export_program(module: ServingDLRM, device: torch.device) -> torch.export.ExportedProgram:
    """``torch.export`` of the serving module with a dynamic batch dimension (1 to MAX_BATCH_ROWS)."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH_ROWS)
    with torch.no_grad():
        return torch.export.export(
            module.to(device), example_inputs(module.inputs, 8, device), dynamic_shapes=({0: batch}, {0: batch}), strict=False
        )


def contract(saved: SavedWeights, module: ServingDLRM, quantize: str, device: torch.device, package_crc32: int) -> dict[str, Any]:
    """The serving contract: what the package takes and returns, what made it, and the package's CRC-32
    (checked by ServingPackage before loading)."""
    import lightning
    import torchrec

    mapping, inputs = module.id_mapping, module.inputs
    id_mapping: dict[str, Any] = {"kind": mapping.kind, "table_sizes": mapping.table_sizes.tolist()}
    if mapping.kind == "vocabulary":
        id_mapping.update(frequency_threshold=saved.frequency_threshold, vocabulary_sizes=mapping.vocabulary_sizes)
    dense_meaning = (
        "raw integer counts as in the logs; a missing value is 0; each is transformed inside as 'transforms' says"
        if inputs.dense_dtype == torch.int64
        else "the columns' values as in the data; a missing value is the column's 'fills' entry; each is transformed inside as 'transforms' says"
    )
    return {
        "format": CONTRACT_FORMAT,
        "package_crc32": f"{package_crc32:08x}",
        "inputs": [
            {"name": inputs.dense_name, "dtype": str(inputs.dense_dtype).removeprefix("torch."),
             "shape": ["batch", len(inputs.dense_features)], "features": inputs.dense_features,
             "transforms": inputs.dense_transforms, "fills": inputs.dense_fills,
             "standardize_mean_std": inputs.dense_statistics, "meaning": dense_meaning},
            {"name": SPARSE_INPUT, "dtype": "int64", "shape": ["batch", len(inputs.id_features)], "features": inputs.id_features,
             "ids": inputs.id_kinds, "meaning": "raw categorical ids (a hex id's integer value, an integer id as it is); "
             "a missing id is 0; mapped inside"},
        ],  # fmt: skip
        "outputs": [{"name": "probability", "dtype": "float32", "shape": ["batch"]}],
        "batch_rows": {"min": 1, "max": MAX_BATCH_ROWS},
        "features_used": inputs.id_features[: module.num_features],
        "data_format": saved.data_layout["format"],
        "id_mapping": id_mapping,
        "quantize": quantize,
        "constant_bytes": constant_bytes(module),  # what the library's constants are (package_size.py reports them)
        "device": device.type,
        "versions": {"torch": torch.__version__, "torchrec": torchrec.__version__, "lightning": lightning.__version__},
        "model": {k: saved.hyper_parameters.get(k) for k in ("interaction", "embedding_dim", "first_order", "second_order")},
    }


def export_pt2(source: Path, target: Path, quantize: str = "none", device: str | None = None) -> Path:
    """Writes the AOTInductor package ``target`` and its contract beside it; returns the package's path."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize = {quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}")
    if target.suffix != ".pt2":
        raise ValueError(f"output = {target}: a pt2 package's name must end in .pt2 (torch's loaders require it)")
    run_on = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    saved = read_saved_weights(source)
    module = build_serving_module(saved, quantize, source)
    started = time.perf_counter()
    program = export_program(module, run_on)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under its final name in a folder beside it (the archive's inner folder is named after the
    # file), then moved: never a half-written package under the final name.
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as partial_dir:
        partial = Path(partial_dir) / target.name
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=COMPILE_SETTINGS)
        if run_on.type == "cpu":  # where loading the rewrite is tested (from Python and C++); CUDA's as written
            slim_package(partial)  # no sources, a stripped library, deflated when small (app/checkpoint/package_size.py)
        crc = file_crc32(partial)
        os.replace(partial, target)
    contract_file = contract_path(target)
    contract_file.write_text(json.dumps(contract(saved, module, quantize, run_on, crc), indent=1) + "\n")
    seconds = time.perf_counter() - started
    print(f"exported {source} as {target} ({target.stat().st_size:,} bytes, {run_on.type}, "
          f"{quantize}, compiled in {seconds:.0f} s) with its contract {contract_file}")  # fmt: skip
    if quantize == "int8":
        print(tables_line(constant_bytes(module)) + f"; the whole file against the float32 package's: {MEASURE_COMMAND}")
    return target


# Measures the whole file's ratio, which needs the float32 package beside the INT8 one (docs/serving.md).
MEASURE_COMMAND = "python -m app.checkpoint.package_size --float32 FLOAT32.pt2 --int8 INT8.pt2"


def tables_line(counted: dict[str, int]) -> str:
    """The INT8 tables' bytes against float32's, and what else the library's constants hold."""
    vocabulary = f", the vocabulary ({counted['vocabulary']:,})" if counted["vocabulary"] else ""
    return (f"int8: tables {counted['tables']:,} bytes, {counted['tables'] / counted['tables_float32']:.3f} of their "
            f"{counted['tables_float32']:,} in float32; beside them, in both packages, the float32 dense layers "
            f"({counted['dense_layers']:,} bytes){vocabulary} and the compiled code")  # fmt: skip
