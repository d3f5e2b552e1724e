"""Loading a ``python -m app export --format pt2`` package and scoring with it, with torch alone.

This module imports nothing but the standard library and torch, so a server may copy it as it is (or load
it by path) without the app, TorchRec or FBGEMM installed::

    from serving_runtime import ServingPackage
    package = ServingPackage("model.pt2")          # reads model.contract.json beside it, checks the CRC-32
    probabilities = package.score(dense_counts, raw_ids)   # (B, 13) and (B, 26) int64 -> (B,) float32

Loading first compares the package's CRC-32 with its contract's: a damaged file is refused in one line
naming it, before torch reads it. A model trained on a data schema takes its dense columns as float64
(``dense_values``) and its id columns, as the contract names them. ``score`` checks the inputs against the contract first (dtype, shape, feature count, batch size, ids that
int64 cannot hold), with a ValueError naming the input: AOTInductor's own checks name inputs by position
only, and an id beyond int64 would otherwise wrap silently in a numpy conversion.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CONTRACT_FORMAT = "app.serving-contract/1"
DENSE_INPUT = "dense_counts"  # Criteo's integer counts, int64
DENSE_VALUES_INPUT = "dense_values"  # a data schema's dense columns, float64
SPARSE_INPUT = "raw_ids"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def contract_path(package: str | Path) -> Path:
    """The contract written beside a package: ``model.pt2`` -> ``model.contract.json``."""
    package = Path(package)
    return package.with_name(package.stem + ".contract.json")


def read_contract(package: str | Path) -> dict[str, Any]:
    """The package's contract; a FileNotFoundError naming the file when it is missing."""
    path = contract_path(package)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the serving contract of {package} is missing (it is written beside the package)")
    contract = json.loads(path.read_text())
    if contract.get("format") != CONTRACT_FORMAT:
        raise ValueError(f"{path}: format {contract.get('format')!r}, expected {CONTRACT_FORMAT!r}")
    return contract


def file_crc32(path: str | Path, chunk_bytes: int = 1 << 22) -> int:
    """The CRC-32 of a file's bytes (zlib's, as ``zipfile`` and the checkpoints' shards use), read in chunks."""
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_package_intact(package: str | Path, contract: dict[str, Any]) -> None:
    """Refuses a package whose bytes are not those its contract records (bit rot, a cut copy), in one line
    naming the file; a contract without a checksum (an older export) is not checked."""
    recorded = contract.get("package_crc32")
    if recorded is None:
        return
    found = file_crc32(package)
    if found != int(recorded, 16):
        raise ValueError(
            f"{package}: damaged (CRC-32 {found:08x}, its contract {contract_path(package).name} records {recorded}); "
            "export it again"
        )


def as_int64(values: Any, name: str) -> torch.Tensor:
    """``values`` (a tensor, numpy array or nested lists of ints) as an int64 tensor; a ValueError naming
    ``name`` for other dtypes and for values int64 cannot hold (never a silent wrap-around)."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.int64:
            raise ValueError(f"input {name}: dtype {values.dtype}, expected torch.int64")
        return values
    dtype = getattr(values, "dtype", None)
    if dtype is not None:  # a numpy array (or anything with a dtype): integers only, checked in range
        if getattr(dtype, "kind", "") not in "iu":
            raise ValueError(f"input {name}: dtype {dtype}, expected int64 integers")
        if dtype.kind == "u" and values.size and int(values.max()) > _INT64_MAX:
            raise ValueError(f"input {name}: id {int(values.max())} is outside int64 ({_INT64_MIN} to {_INT64_MAX})")
        return torch.from_numpy(values.astype("int64", copy=False))
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (RuntimeError, OverflowError, ValueError) as error:  # a Python int beyond int64 ("Overflow when unpacking")
        raise ValueError(f"input {name}: a value is outside int64 ({_INT64_MIN} to {_INT64_MAX}): {error}") from None
    except TypeError as error:
        raise ValueError(f"input {name}: not integers: {error}") from None


def as_float64(values: Any, name: str) -> torch.Tensor:
    """``values`` (a float64 tensor, or a numpy array or nested lists of numbers) as a float64 tensor; a
    ValueError naming ``name`` for other tensor dtypes and for values that are not numbers."""
    if isinstance(values, torch.Tensor):
        if values.dtype != torch.float64:
            raise ValueError(f"input {name}: dtype {values.dtype}, expected torch.float64")
        return values
    dtype = getattr(values, "dtype", None)
    if dtype is not None and getattr(dtype, "kind", "") not in "iuf":
        raise ValueError(f"input {name}: dtype {dtype}, expected numbers")
    try:
        return torch.as_tensor(values, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"input {name}: not numbers: {error}") from None


def as_input(values: Any, spec: dict[str, Any]) -> torch.Tensor:
    """``values`` as the tensor the contract's input ``spec`` names (int64 or float64), checked."""
    return as_float64(values, spec["name"]) if spec["dtype"] == "float64" else as_int64(values, spec["name"])


def check_inputs(contract: dict[str, Any], inputs: Sequence[torch.Tensor]) -> None:
    """Raises a ValueError naming the input whose dtype, rank, feature count or batch size the contract refuses."""
    specs = contract["inputs"]
    if len(inputs) != len(specs):
        raise ValueError(f"{len(inputs)} inputs given, the package takes {len(specs)}: {', '.join(s['name'] for s in specs)}")
    batch_rows = contract["batch_rows"]
    rows = None
    for tensor, spec in zip(inputs, specs):
        name, width = spec["name"], spec["shape"][1]
        if str(tensor.dtype) != f"torch.{spec['dtype']}":
            raise ValueError(f"input {name}: dtype {tensor.dtype}, expected torch.{spec['dtype']}")
        if tensor.dim() != 2:
            raise ValueError(f"input {name}: shape {tuple(tensor.shape)}, expected (batch, {width})")
        if tensor.shape[1] != width:
            raise ValueError(f"input {name}: {tensor.shape[1]} features, expected {width} ({spec['features'][0]}..{spec['features'][-1]})")
        if not batch_rows["min"] <= tensor.shape[0] <= batch_rows["max"]:
            raise ValueError(f"input {name}: {tensor.shape[0]} rows, expected {batch_rows['min']} to {batch_rows['max']}")
        if rows is not None and tensor.shape[0] != rows:
            raise ValueError(f"input {name}: {tensor.shape[0]} rows, but {specs[0]['name']} has {rows}")
        rows = tensor.shape[0]


def read_tsv_rows(path: str | Path, labelled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of a Criteo TSV file as the package takes them: dense counts (N, 13), raw ids (N, 26) (the hex
    ids' values; an empty field is 0) and labels (N,) float32 (-1 where not ``labelled``: 39 fields).
    Plain Python: for examples and checks, not a fast reader."""
    dense, ids, labels = [], [], []
    for line in Path(path).read_text().splitlines():
        fields = line.split("\t")
        label, fields = (float(fields[0]), fields[1:]) if labelled else (-1.0, fields)
        fields += [""] * (39 - len(fields))  # trailing empty fields may be stripped
        dense.append([int(x) if x else 0 for x in fields[:13]])
        ids.append([int(x, 16) if x else 0 for x in fields[13:]])
        labels.append(label)
    return torch.tensor(dense, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64), torch.tensor(labels)


class ServingPackage:
    """A loaded package and its contract: ``score(dense, raw_ids)`` -> click probabilities (B,)."""

    def __init__(self, package: str | Path, device: str | None = None) -> None:
        self.path = Path(package)
        self.contract = read_contract(self.path)
        check_package_intact(self.path, self.contract)  # before torch reads a byte of it
        self.device = torch.device(device or self.contract["device"])
        # torch's own error if the package was made by another torch version; the contract names that version.
        self.model = torch._inductor.aoti_load_package(str(self.path))

    def score(self, dense: Any, raw_ids: Any) -> torch.Tensor:
        """Click probabilities (B,) float32 on the CPU for B rows of dense inputs (Criteo's raw counts, int64;
        a data schema's column values, float64: the contract's first input) and raw ids (checked, then run on
        the package's device)."""
        inputs = [as_input(values, spec) for values, spec in zip((dense, raw_ids), self.contract["inputs"])]
        check_inputs(self.contract, inputs)
        with torch.no_grad():
            return self.model(*(tensor.to(self.device) for tensor in inputs)).cpu()
