"""``python -m app export --format pt2 [--quantize int8]``: one AOTInductor package a server loads with torch
alone, and its serving contract beside it.

The package (``torch._inductor.aoti_compile_and_package``) holds the whole model compiled for this
machine's device (CPU here; CUDA where the export runs on a GPU), with the raw-id mapping it was trained
with (app/checkpoint/serving_graph.py). It takes two int64 inputs with a dynamic batch dimension and
returns click probabilities; ``torch._inductor.aoti_load_package`` loads it in Python and
``torch::inductor::AOTIModelPackageLoader`` in C++. The contract, ``<package stem>.contract.json``, says
what the inputs are (names, dtypes, shapes, feature order), how ids are mapped, and which versions made
the package; app/checkpoint/serving_runtime.py checks inputs against it (docs/serving.md).

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

import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from app.checkpoint.export import read_model_tensors
from app.checkpoint.saved_model import read_saved_model
from app.checkpoint.serving_graph import MIN_QUANTIZED_ROWS, IdMapping, RowWiseInt8, ServingDLRM
from app.checkpoint.serving_runtime import CONTRACT_FORMAT, DENSE_INPUT, SPARSE_INPUT, contract_path
from app.criteo import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from app.model.dlrm import build_dlrm, build_dlrm_arguments, table_name

LOWERED_INTERACTIONS = ("dot", "cat", "dcn", "projection")
QUANTIZE_CHOICES = ("none", "int8")
# The batch dimension's range: 1 row (one request) up to what one call may score.
MAX_BATCH_ROWS = 65_536
# No line tables (-g1) in the compiled code: they are about 1.4 MB of every package (more than the demo's
# tables) and serve only a debugger; AOT_INDUCTOR_DEBUG_SYMBOLS=1 still adds full symbols when wanted.
COMPILE_SETTINGS = {"aot_inductor.enable_line_tables": False}
_TABLE_PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags."


@dataclass(frozen=True)
class SavedWeights:
    """What a checkpoint folder or an exported model file holds for serving."""

    hyper_parameters: dict[str, Any]
    state_dict: dict[str, torch.Tensor]
    vocabulary_ids: list[torch.Tensor] | None  # 26 sorted int64 tensors, or None for hashed ids
    frequency_threshold: int


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
        ids = [torch.as_tensor(array, dtype=torch.int64) for array in arrays]
    return SavedWeights(dict(hyper_parameters), state_dict, ids, threshold)


def check_lowerable(hyper_parameters: dict[str, Any], source: Path) -> None:
    """Refuses, naming the setting, a model the serving graph does not reproduce."""
    interaction = hyper_parameters.get("interaction", "dot")
    if interaction not in LOWERED_INTERACTIONS:
        raise ValueError(
            f"ckpt_path {source}: model.interaction = {interaction!r} has no plain-torch serving graph "
            f"(the pt2 export lowers {', '.join(LOWERED_INTERACTIONS)})"
        )


def serving_tables(saved: SavedWeights, quantize: str, report=print) -> list[torch.Tensor | RowWiseInt8]:
    """The tables in feature order, row-wise INT8 where ``quantize`` asks and a table is large enough."""
    tables = []
    for feature in DEFAULT_CAT_NAMES:  # the model's names of C1..C26, in order
        weight = saved.state_dict.get(f"{_TABLE_PREFIX}{table_name(feature)}.weight")
        if weight is None:
            break
        tables.append(weight)
    small = []
    if quantize == "int8":
        small = [SPARSE_NAMES[j] for j, weight in enumerate(tables) if weight.shape[0] < MIN_QUANTIZED_ROWS]
        tables = [weight if weight.shape[0] < MIN_QUANTIZED_ROWS else RowWiseInt8.of(weight) for weight in tables]
    if small:
        report(
            f"int8: {len(small)} table(s) under {MIN_QUANTIZED_ROWS} rows stay float32 (too small to quantise "
            f"usefully): {', '.join(small)}"
        )
    return tables


def build_serving_module(saved: SavedWeights, quantize: str, source: Path, report=print) -> ServingDLRM:
    """The plain-torch serving module of a saved model (the trained dense parts, the tables, the id mapping)."""
    check_lowerable(saved.hyper_parameters, source)
    tables = serving_tables(saved, quantize, report)
    if not tables:
        raise ValueError(f"ckpt_path {source} holds no embedding table under {_TABLE_PREFIX}")
    sizes = [int((t.codes if isinstance(t, RowWiseInt8) else t).shape[0]) for t in tables]
    settings = dict(build_dlrm_arguments(saved.hyper_parameters), num_embeddings_per_feature=sizes, embedding_device="meta")
    trained = build_dlrm(**settings)
    for part in ("dense_arch", "inter_arch", "over_arch"):
        prefix = f"model.{part}."
        state = {k[len(prefix) :]: v for k, v in saved.state_dict.items() if k.startswith(prefix)}
        getattr(trained, part).load_state_dict(state)
    vocabularies = saved.vocabulary_ids[: len(tables)] if saved.vocabulary_ids is not None else None
    hp = saved.hyper_parameters
    module = ServingDLRM(trained, tables, IdMapping(sizes, vocabularies), bool(hp.get("first_order")), bool(hp.get("second_order")))
    return module.eval()


def example_inputs(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randint(0, 1000, (rows, NUM_DENSE), generator=generator, dtype=torch.int64)
    sparse = torch.randint(0, 2**32, (rows, NUM_SPARSE), generator=generator, dtype=torch.int64)
    return dense.to(device), sparse.to(device)


def export_program(module: ServingDLRM, device: torch.device) -> torch.export.ExportedProgram:
    """``torch.export`` of the serving module with a dynamic batch dimension (1 to MAX_BATCH_ROWS)."""
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH_ROWS)
    with torch.no_grad():
        return torch.export.export(
            module.to(device), example_inputs(8, device), dynamic_shapes=({0: batch}, {0: batch}), strict=False
        )


def contract(saved: SavedWeights, module: ServingDLRM, quantize: str, device: torch.device) -> dict[str, Any]:
    """The serving contract: what the package takes and returns, and what made it."""
    import lightning
    import torchrec

    mapping = module.id_mapping
    id_mapping: dict[str, Any] = {"kind": mapping.kind, "table_sizes": mapping.table_sizes.tolist()}
    if mapping.kind == "vocabulary":
        id_mapping.update(frequency_threshold=saved.frequency_threshold, vocabulary_sizes=mapping.vocabulary_sizes)
    return {
        "format": CONTRACT_FORMAT,
        "inputs": [
            {"name": DENSE_INPUT, "dtype": "int64", "shape": ["batch", NUM_DENSE], "features": list(DENSE_NAMES),
             "meaning": "raw integer counts as in the logs; a missing value is 0; log(max(x, 0) + 1) is applied inside"},
            {"name": SPARSE_INPUT, "dtype": "int64", "shape": ["batch", NUM_SPARSE], "features": list(SPARSE_NAMES),
             "meaning": "raw categorical ids (the hex id's integer value); a missing id is 0; mapped inside"},
        ],  # fmt: skip
        "outputs": [{"name": "probability", "dtype": "float32", "shape": ["batch"]}],
        "batch_rows": {"min": 1, "max": MAX_BATCH_ROWS},
        "features_used": list(SPARSE_NAMES[: module.num_features]),
        "id_mapping": id_mapping,
        "quantize": quantize,
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
        os.replace(partial, target)
    contract_file = contract_path(target)
    contract_file.write_text(json.dumps(contract(saved, module, quantize, run_on), indent=1) + "\n")
    seconds = time.perf_counter() - started
    print(f"exported {source} as {target} ({target.stat().st_size / 2**20:.1f} MiB, {run_on.type}, "
          f"{quantize}, compiled in {seconds:.0f} s) with its contract {contract_file}")  # fmt: skip
    return target
