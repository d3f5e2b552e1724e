"""``python -m app export``: one unsharded model file from a sharded checkpoint, and loading it back.

The file is a plain ``torch.save`` dictionary that ``torch.load(path, weights_only=True)`` reads in one
process without TorchRec's distributed machinery::

    {"format": "app.export/1",
     "pytorch-lightning_version": "2.6.6",
     "hyper_parameters": {...},          # DLRMModule's __init__ arguments (plain data)
     "state_dict": {name: tensor, ...},  # DLRMModule.state_dict() keys, every table whole
     "CriteoDataModule": {...}}          # only with data.frequency_threshold: the threshold and its
                                         # vocabulary (26 int64 tensors), app/checkpoint/vocabulary.py

Example::

    python -m app export --ckpt_path runs/demo/checkpoints/last.ckpt --output model.pt
    python -m app predict --config configs/demo.yaml --ckpt_path model.pt

Export runs in a single process and holds the whole model once (what an unsharded file is). It reads
only the model's tensors from the checkpoint, not the optimizer state. TorchRec's own
``dcp_to_torch_save`` would do the reading too, but it loads everything in the checkpoint, optimizer
state included, with nested keys this file does not want.

When ``predict`` (or ``validate``/``test``) is given an exported file, the hyper-parameters in it set
the model (LightningCLI reads them from a checkpoint file) and each rank copies only the rows and
columns of its own shards out of the memory-mapped file.

The file proves it is intact: ``torch.save`` writes a zip archive with a CRC-32 of every record (the
pickle, each tensor's bytes), and every reader checks them all (:func:`check_export_intact`) before it
uses anything of the file; a mismatch is refused as damaged, naming the file.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Literal

import lightning
import torch
import torch.distributed.checkpoint as dcp
from jsonargparse import CLI
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from app.checkpoint.best import BEST, find_best_checkpoint
from app.checkpoint.format import SafeFileSystemReader
from app.checkpoint.format import read as read_checkpoint
from app.checkpoint.vocabulary import exported_data_state
from app.command import exit_on_bad_config_files

EXPORT_FORMAT = "app.export/1"
_MODEL_PREFIX = "state_dict."


def read_model_tensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a sharded checkpoint, assembled whole in this process (no process group)."""
    metadata = SafeFileSystemReader(checkpoint_dir).read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(md.size, dtype=md.properties.dtype)
        for key, md in metadata.items()
        if key.startswith(_MODEL_PREFIX) and isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint_dir), no_dist=True)
    return {key[len(_MODEL_PREFIX) :]: value for key, value in tensors.items()}


def plain_hyper_parameters(hyper_parameters: dict[str, Any], source: Path) -> dict[str, Any]:
    """The hyper-parameters as JSON-like data (what ``weights_only`` loading accepts)."""
    try:
        return json.loads(json.dumps(dict(hyper_parameters)))
    except TypeError as error:
        raise ValueError(f"{source}: hyper-parameters that are not plain data: {error}") from None


def export_checkpoint(
    ckpt_path: str,
    output: str = "model.pt",
    checkpoint_dir: str | None = None,
    format: Literal["torch", "pt2"] = "torch",
    quantize: Literal["none", "int8"] = "none",
) -> Path:
    """Writes one unsharded model file, or with ``--format pt2`` a package servers load with torch alone.

    The model file holds plain tensors and the model's hyper-parameters; the pt2 package is compiled with
    AOTInductor, the id mapping inside (docs/serving.md).

    Args:
        ckpt_path: a sharded checkpoint folder written by ``python -m app fit`` (e.g.
            ``runs/demo/checkpoints/last.ckpt``), or ``best``: the checkpoint in ``checkpoint_dir`` that
            the run ranked best by its checkpoint group's monitor (app/checkpoint/best.py).
        output: the file to write; replaced atomically if it exists.
        checkpoint_dir: the run's checkpoint folder, for ``--ckpt_path best`` (e.g. ``runs/demo/checkpoints``).
        format: ``torch`` (a ``torch.save`` file that ``predict`` takes) or ``pt2`` (an AOTInductor package
            with the id mapping inside, and its serving contract ``<name>.contract.json`` beside it; ``ckpt_path``
            may then also be a file from ``--format torch``).
        quantize: ``none``, or ``int8`` (``--format pt2`` only): row-wise INT8 tables dequantised in the graph.
    """
    if format not in ("torch", "pt2"):
        raise ValueError(f"format = {format!r} is not one of torch, pt2")
    if quantize != "none" and format != "pt2":
        raise ValueError(f"quantize = {quantize!r} needs format = pt2 (format = {format!r} keeps the trained tables)")
    if ckpt_path == BEST:
        if checkpoint_dir is None:
            raise ValueError("export --ckpt_path best: name the run's checkpoint folder with --checkpoint_dir")
        best = find_best_checkpoint(checkpoint_dir)  # by the monitor the run's checkpoints were ranked by
        print(best.describe())
        ckpt_path = str(best.path)
    source = Path(ckpt_path).expanduser()
    if format == "pt2":
        from app.checkpoint.export_pt2 import export_pt2  # it reads checkpoints through this module

        return export_pt2(source, Path(output).expanduser(), quantize)
    info = read_checkpoint(source)  # complete, readable, plain-data metadata; a ValueError naming the path if not
    hyper_parameters = info.meta.get("hyper_parameters") or {}
    state_dict = read_model_tensors(info.path)
    exported = {
        "format": EXPORT_FORMAT,
        # Lightning reads it from anything given as --ckpt_path (checkpoint migration).
        "pytorch-lightning_version": lightning.__version__,
        "hyper_parameters": plain_hyper_parameters(hyper_parameters, source),
        "state_dict": state_dict,
        **exported_data_state(info.meta),  # predict from this file maps ids as training did; the layout for pt2
    }
    target = Path(output).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    recording = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # the records' CRC-32s are the file's checksum
    try:
        torch.save(exported, partial)
    finally:
        torch.serialization.set_crc32_options(recording)
    os.replace(partial, target)  # never a half-written model file under the final name
    print(f"exported {len(state_dict)} tensors from {source} to {target}")
    return target


_INTACT: set[tuple[str, int, int]] = set()  # (path, size, mtime) of files checked in this process


def check_export_intact(path: str | Path) -> None:
    """Refuses, in one line naming the file, a model file whose records differ from the CRC-32s torch.save
    wrote beside them (bit rot, a damaged copy). Files that are not zip archives are left to the caller's
    format check. Each file is read once per process, however many times it is loaded."""
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _INTACT or not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every record and compares its CRC-32
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError) as error:
        raise ValueError(f"{path}: damaged (its archive cannot be read: {error}); export it again from its checkpoint") from None
    if bad is not None:
        raise ValueError(f"{path}: damaged (record {bad} does not match its CRC-32); export it again from its checkpoint")
    _INTACT.add(key)


def is_exported_model(path: str | Path) -> bool:
    """Whether ``path`` is a file (an exported model) rather than a sharded checkpoint folder."""
    return Path(path).is_file()


def load_exported_into(path: str | Path, module: nn.Module) -> dict[str, Any]:
    """Copies an exported model's weights into ``module``, whatever its sharding; returns the file's content
    without the tensors.

    The file is memory-mapped, so a rank reads only the rows and columns of the shards it holds.
    """
    path = Path(path)
    check_export_intact(path)
    try:
        exported = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated file, or not a torch file at all
        raise ValueError(f"{path} is neither a sharded checkpoint folder nor a model file from `python -m app export`: {error}") from None
    if not isinstance(exported, dict) or exported.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{path} is not a model file from `python -m app export` (no format {EXPORT_FORMAT!r})")
    saved = exported["state_dict"]
    target = module.state_dict()
    missing = sorted(set(target) - set(saved))
    if missing:
        raise ValueError(f"{path} does not hold {missing[:3]}{' ...' if len(missing) > 3 else ''}: a different model")
    with torch.no_grad():
        for key, value in target.items():
            _copy_held_part(value, saved[key], f"{path}: {key}")
    module.load_state_dict(target)
    return {k: v for k, v in exported.items() if k != "state_dict"}


def _copy_held_part(target: torch.Tensor, full: torch.Tensor, where: str) -> None:
    if tuple(target.size()) != tuple(full.size()):
        raise ValueError(f"{where} has shape {tuple(full.size())}; this model's is {tuple(target.size())}")
    if not isinstance(target, ShardedTensor):
        target.copy_(full)
        return
    for shard in target.local_shards():
        index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
        shard.tensor.copy_(full[index])


def main(args: list[str] | None = None) -> None:
    """``python -m app export --ckpt_path CKPT --output model.pt`` (``--help``, ``--config``)."""
    exit_on_bad_config_files(sys.argv[1:] if args is None else args)  # a YAML error names its file, line, column
    try:
        CLI(export_checkpoint, args=args, as_positional=False, prog="python -m app export")
    except (ValueError, OSError) as error:  # a user's bad path: one line, as `python -m app` shows it
        if os.environ.get("APP_TRACEBACK"):
            raise
        print(f"error: {error}\n(set APP_TRACEBACK=1 to see the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
