"""``predictions.tsv`` and its record ``predictions.json``: what a predictions file holds, said when it is replaced.

``predict`` writes into a run folder that may already hold predictions, of this checkpoint or of
another one. So beside the rows goes ``predictions.json``: the checkpoint scored, its global step,
the input files and the row count; a later ``predict`` into the same folder reads it back and says
in its log line what it replaces.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

PREDICTIONS_FILE = "predictions.tsv"
RECORD_FILE = "predictions.json"


@dataclass(frozen=True)
class PredictionsRecord:
    """What a predictions file holds."""

    checkpoint: str | None  # the ckpt_path scored (None: the model as built, untrained)
    global_step: int | None  # the checkpoint's training steps (None: unknown, an exported model file)
    inputs: list[str]  # data.predict as set
    rows: int

    def describe(self) -> str:
        model = "an untrained model" if self.checkpoint is None else self.checkpoint
        step = "" if self.global_step is None else f" at step {self.global_step}"
        return f"{self.rows} predictions of {model}{step} on {', '.join(self.inputs) or 'no recorded input'}"


def write_predictions(
    folder: Path,
    row_ids: torch.Tensor,
    probabilities: torch.Tensor,
    record: PredictionsRecord,
    keys: dict[str, Sequence[str]] | None = None,
) -> str:
    """Writes ``folder/predictions.tsv`` (a header, then ``row_id<TAB>probability`` in row order, then each
    of ``keys``' columns, looked up by row id) and its record; returns the line for the log, which says
    what an existing file held."""
    path = folder / PREDICTIONS_FILE
    replaced = _replaced(folder) if path.exists() else None
    folder.mkdir(parents=True, exist_ok=True)
    keys = keys or {}
    rows = "".join(
        f"{r}\t{p:.6f}" + "".join(f"\t{column[r]}" for column in keys.values()) + "\n"
        for r, p in zip(row_ids.tolist(), probabilities.tolist())
    )
    _replace(path, "\t".join(["row_id", "probability", *keys]) + "\n" + rows)
    _replace(folder / RECORD_FILE, json.dumps(asdict(record), indent=1) + "\n")
    line = f"wrote {record.describe()} to {path}"
    return line if replaced is None else f"{line}, replacing {replaced}"


def _replaced(folder: Path) -> str:
    """What the predictions file in ``folder`` holds, as its record says."""
    try:
        return PredictionsRecord(**json.loads((folder / RECORD_FILE).read_text())).describe()
    except (OSError, ValueError, TypeError):  # no record (written before records were kept), or not one
        return f"a {PREDICTIONS_FILE} without a readable {RECORD_FILE} (of an unknown checkpoint)"


def _replace(path: Path, text: str) -> None:
    # Beside it, then one rename: a reader sees the old file or the new one, never half of one.
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)
