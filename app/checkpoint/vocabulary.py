"""``data.frequency_threshold``'s vocabulary in checkpoints and exported models, so that a later
``validate``/``test``/``predict`` maps ids exactly as training did, without the training data.

The data module's checkpoint state (Lightning keeps it under the module's class name) is
``{"frequency_threshold": T, "vocabulary": Vocabulary}``. The vocabulary's arrays are too large for
``meta.json`` (8 bytes per kept id), so:

* a checkpoint folder holds them in ``vocabulary/`` (``vocab_feature_j.npy`` and ``vocabulary.json``,
  the preprocessor's layout; hard-linked from the data cache where the file system allows), and
  ``meta.json`` a reference with the threshold, sizes and SHA-256; reading the checkpoint gives the
  state back with the vocabulary memory-mapped;
* an exported model file holds them as int64 tensors (``Vocabulary.to_plain``), read with
  ``torch.load(weights_only=True)`` like the rest of the file; Lightning hands that entry to the data
  module when ``predict`` restores the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.data.layout import DATA_LAYOUT_KEY
from app.data.preprocess import Vocabulary

VOCABULARY_FOLDER = "vocabulary"
_REFERENCE = "saved_in"  # the key of the reference meta.json holds instead of the arrays


def _states_with_vocabulary(meta: dict[str, Any]) -> list[str]:
    """Keys of the checkpoint entries that are a data module's state holding a vocabulary."""
    return [key for key, value in meta.items() if isinstance(value, dict) and value.get("vocabulary") is not None]


def save_vocabulary(meta: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``meta`` with each vocabulary written into ``folder/vocabulary/`` and replaced by a reference
    (plain data for meta.json). Called by rank 0 before meta.json, which marks the folder complete."""
    saved = dict(meta)
    for key in _states_with_vocabulary(meta):
        vocabulary = meta[key]["vocabulary"]
        if isinstance(vocabulary, Vocabulary):
            vocabulary.save(folder / VOCABULARY_FOLDER)
            saved[key] = dict(meta[key], vocabulary=dict(vocabulary.describe(), **{_REFERENCE: VOCABULARY_FOLDER}))
    return saved


def load_vocabulary(meta: dict[str, Any], folder: Path, path: Any) -> dict[str, Any]:
    """``meta`` read from a checkpoint folder, with each vocabulary reference replaced by the
    vocabulary it names (memory-mapped). ``path``: the checkpoint as given, for the error message."""
    for key in _states_with_vocabulary(meta):
        reference = meta[key]["vocabulary"]
        if isinstance(reference, dict) and _REFERENCE in reference:
            where = folder / reference[_REFERENCE]
            try:
                meta[key] = dict(meta[key], vocabulary=Vocabulary.load(where))
            except FileNotFoundError as error:
                raise ValueError(f"ckpt_path {path}: its vocabulary is incomplete ({error}); an incomplete copy?") from None
    return meta


def exported_data_state(meta: dict[str, Any]) -> dict[str, Any]:
    """The data module's checkpoint entry (its threshold and vocabulary, its training data's layout), in an
    exported file's form (plain data and tensors)."""
    exported = {}
    for key, state in meta.items():
        if not (isinstance(state, dict) and _is_data_module_state(state)):
            continue
        exported[key] = dict(state)
        vocabulary = state.get("vocabulary")
        if isinstance(vocabulary, Vocabulary):
            exported[key]["vocabulary"] = vocabulary.to_plain()
    return exported


def _is_data_module_state(state: dict[str, Any]) -> bool:
    return "frequency_threshold" in state or DATA_LAYOUT_KEY in state


def trained_threshold(meta: dict[str, Any]) -> int:
    """The data.frequency_threshold a checkpoint was trained with (0: none)."""
    thresholds = [meta[key].get("frequency_threshold", 0) for key in _states_with_vocabulary(meta)]
    return int(max(thresholds, default=0))


def data_module_state(contents: dict[str, Any]) -> dict[str, Any]:
    """The data module's checkpoint state in a checkpoint's metadata or an exported file (Lightning keeps
    it under the module's class name): ``{"frequency_threshold": T, "vocabulary": ..., "data_layout": ...}``
    (the threshold and vocabulary only with a threshold; the layout only in checkpoints that record it),
    or {} when there is neither."""
    for value in contents.values():
        if isinstance(value, dict) and _is_data_module_state(value):
            return value
    return {}
