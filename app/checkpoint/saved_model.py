"""What a checkpoint (or an exported model file) says about the model it holds, read once per load.

A checkpoint carries its model: the module's hyper-parameters (the table sizes among them) and the
data module's state (``data.frequency_threshold`` and its vocabulary, and the layout of the data it
was trained on: the features and how each was made, app/data/layout.py). ``validate``, ``test``,
``predict``, ``export`` and a resumed ``fit`` take them from here, so that none of them reads the
training data again to learn sizes and a vocabulary the checkpoint already holds (app/cli.py applies
them to the run's settings before anything is built).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from app.checkpoint.export import EXPORT_FORMAT, check_export_intact, is_exported_model
from app.checkpoint.format import CheckpointInfo
from app.checkpoint.format import read as read_checkpoint
from app.checkpoint.vocabulary import data_module_state
from app.data.layout import saved_layout


@dataclass(frozen=True)
class SavedModel:
    """The model a checkpoint holds, as plain settings."""

    path: str  # as given
    hyper_parameters: dict[str, Any]  # the LightningModule's __init__ arguments
    data_state: dict[str, Any] = field(default_factory=dict)  # the data module's: threshold, vocabulary, layout
    info: CheckpointInfo | None = None  # a sharded checkpoint's metadata (None: an exported file)

    @property
    def frequency_threshold(self) -> int:
        return int(self.data_state.get("frequency_threshold", 0))

    @property
    def data_layout(self) -> dict[str, Any]:
        """The features the model was trained on and how each was made (Criteo's TSV layout for a
        checkpoint that does not record one)."""
        return saved_layout(self.data_state)


def read_saved_model(path: str | os.PathLike) -> SavedModel:
    """Reads the model settings of a checkpoint folder or an exported model file; a ValueError naming
    the path when it is neither, or is incomplete."""
    if is_exported_model(path):
        return _read_exported(Path(path))
    info = read_checkpoint(path)  # complete and readable, or a ValueError naming the path
    hyper_parameters = dict(info.meta.get("hyper_parameters") or {})
    return SavedModel(str(path), hyper_parameters, data_module_state(info.meta), info)


def _read_exported(path: Path) -> SavedModel:
    check_export_intact(path)  # before any of it is read: a damaged file refused naming it
    try:
        # Memory-mapped: only the small entries are read here, not the tables.
        contents = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # a truncated file, or not a torch file at all
        raise ValueError(
            f"ckpt_path {path} is neither a checkpoint folder of this app nor a model file from `python -m app export` "
            f"({type(error).__name__})"
        ) from None
    if not isinstance(contents, dict) or contents.get("format") != EXPORT_FORMAT:
        raise ValueError(f"ckpt_path {path} is not a model file from `python -m app export` (no format {EXPORT_FORMAT!r})")
    return SavedModel(str(path), dict(contents.get("hyper_parameters") or {}), data_module_state(contents))


@dataclass
class SettingsFromCheckpoint:
    """The run's settings to change so that the model built is the checkpoint's."""

    model: dict[str, Any] = field(default_factory=dict)  # model.<key> -> the checkpoint's value
    data: dict[str, Any] = field(default_factory=dict)  # data.<key> -> the checkpoint's value
    taken: list[str] = field(default_factory=list)  # "model.key = value" for the log


def settings_from_checkpoint(
    saved: SavedModel,
    model: dict[str, Any],
    model_defaults: dict[str, Any],
    data: dict[str, Any],
    data_defaults: dict[str, Any],
    run_settings: frozenset[str],
) -> SettingsFromCheckpoint:
    """What the run must take from ``saved``: every hyper-parameter of the model this run left at its
    default, the table sizes and ``data.frequency_threshold``. A setting this run gives that contradicts
    the checkpoint is refused naming both values. ``run_settings`` (how a run trains or evaluates:
    learning rates, pipeline, compile, ...) are not the model: they stay this run's.

    ``model``/``data``: this run's settings; ``*_defaults``: the values they have when not given.
    """
    taken = SettingsFromCheckpoint()
    for key, value in sorted(saved.hyper_parameters.items()):
        if key == "num_embeddings_per_feature" or key in run_settings or key not in model or _same(model[key], value):
            continue  # this run's own: how it trains or evaluates (its config, or the defaults)
        if _same(model[key], model_defaults.get(key, _UNSET)):
            taken.model[key] = value
            taken.taken.append(f"model.{key} = {value!r}")
            continue
        raise _contradiction(saved, f"model.{key}", model[key], value)
    sizes = saved.hyper_parameters.get("num_embeddings_per_feature")
    if sizes is not None and "num_embeddings_per_feature" in data:
        _take_data_setting(taken, saved, data, data_defaults, "num_embeddings_per_feature", sizes, also_default="auto")
    if "frequency_threshold" in data:
        _take_data_setting(taken, saved, data, data_defaults, "frequency_threshold", saved.frequency_threshold)
    return taken


_UNSET = object()


def check_same_features(saved: SavedModel, features: dict[str, Any] | None) -> None:
    """Refuses a run whose ``data.schema`` gives the model other features than the checkpoint's, naming the
    first that differs: a table's pooling, or a feature's order, changes no weight's shape, so the weights
    would load into another model without a word. A checkpoint without features holds Criteo's model."""
    there = saved.hyper_parameters.get("features")
    if there == features:
        return
    describe = (lambda f: "Criteo's 13 dense and 26 categorical features" if f is None else _feature_list(f))
    here_list, there_list = describe(features), describe(there)
    first = next((i for i, (a, b) in enumerate(zip(here_list, there_list)) if a != b), min(len(here_list), len(there_list)))
    show = (lambda items: items if isinstance(items, str) else (items[first] if first < len(items) else "none"))
    raise ValueError(
        f"data.schema gives the model other features than ckpt_path {saved.path} holds: {show(there_list)} there, "
        f"{show(here_list)} here; give the data.schema the checkpoint was trained with"
    )


def _feature_list(features: dict[str, Any]) -> list[str]:
    dense = [f"dense {name!r}" for name in features["dense"]]
    categorical = [
        f"{c['name']!r} (table {c['table']!r}, dim {c['dim'] or 'model.embedding_dim'}, pooling {c['pooling']})"
        for c in features["categorical"]
    ]
    return dense + categorical


def _take_data_setting(
    taken: SettingsFromCheckpoint, saved: SavedModel, data: dict[str, Any], defaults: dict[str, Any], key: str,
    value: Any, also_default: Any = _UNSET,
) -> None:
    here = data[key]
    if _same(here, value) or _same_table_sizes(key, here, value):
        return
    if here == also_default or _same(here, defaults.get(key, _UNSET)):
        taken.data[key] = value
        taken.taken.append(f"data.{key} = {value!r}")
        return
    raise _contradiction(saved, f"data.{key}", here, value)


def _same(here: Any, there: Any) -> bool:
    plain = (lambda v: list(v) if isinstance(v, tuple) else v)
    return plain(here) == plain(there)


def _same_table_sizes(key: str, here: Any, there: Any) -> bool:
    """One size for all and 26 equal sizes are the same tables."""
    if key != "num_embeddings_per_feature" or here == "auto":
        return False
    expand = (lambda v: [v] * len(there) if isinstance(v, int) and isinstance(there, list) else v)
    return _same(expand(here), there)


def _contradiction(saved: SavedModel, setting: str, here: Any, there: Any) -> ValueError:
    return ValueError(
        f"{setting} = {here!r} here, but ckpt_path {saved.path} holds a model with {setting} = {there!r}: "
        f"leave {setting} out (the checkpoint's is taken) or give a checkpoint trained with {here!r}"
    )
