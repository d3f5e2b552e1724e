"""``--ckpt_path best``: the checkpoint a finished run ranked best by its checkpoint group's monitor.

Lightning resolves ``best`` from ``trainer.checkpoint_callback.best_model_path``, which only the
process that ran ``fit`` holds; ``validate``, ``test``, ``predict`` and ``export`` run later, in new
processes, where it is empty. The run's checkpoints keep it, though: ModelCheckpoint's state (its
``best_model_path`` and ``best_model_score``) is saved in every checkpoint's ``meta.json``, under a
key that names the monitor and mode it ranks by. ``last.ckpt`` (the folder's run: what ``--ckpt_path
last`` resumes), else the newest checkpoint, holds the newest record, so this module reads that record
and checks that the checkpoint it names is still there and is that run's own: its own record lists it
by the path and score the record names. Another run's checkpoint of the same name does not (a fit
started from another run's checkpoint carries that run's best until its own first validation; a
folder two runs wrote before runs were kept apart, app/checkpoint/run_folder.py).

Nothing here depends on the process that runs it: every rank that resolves ``best`` from the same
folder gets the same path (nothing writes checkpoints before every rank has joined the job).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.checkpoint.format import META_FILE, from_json_data
from app.checkpoint.run_folder import LAST_FILE

BEST = "best"  # the ckpt_path value resolved here
_RECORD_PREFIX = "ModelCheckpoint{"  # Lightning's state key: the class name, then its monitor, mode, ...


@dataclass(frozen=True)
class BestCheckpoint:
    """The checkpoint a run ranked best, and where that ranking was read."""

    path: Path  # inside the checkpoint folder searched
    monitor: str
    mode: str  # "max" or "min"
    score: float  # the monitored value when it was saved
    recorded_in: Path  # the newest checkpoint, whose ModelCheckpoint state named it

    def describe(self) -> str:
        """One line for the log."""
        return f"ckpt_path best: {self.path} ({self.monitor} = {self.score:.6g}, mode {self.mode}; as recorded in {self.recorded_in.name})"


def find_best_checkpoint(checkpoint_dir: str | os.PathLike, monitor: str | None = None, mode: str | None = None) -> BestCheckpoint:
    """The checkpoint in ``checkpoint_dir`` that its run ranked best by ``monitor`` in ``mode``.

    ``monitor``/``mode`` None: whichever the checkpoints were ranked by (one ranking recorded).
    Raises FileNotFoundError when the folder holds no complete checkpoint or the best one named in
    the newest checkpoint's record is gone, ValueError when no record ranks by ``monitor``/``mode``.
    """
    folder = Path(checkpoint_dir).expanduser()
    newest, meta = _record_holder(folder)
    records = [r for r in _rankings(meta) if monitor in (None, r["monitor"]) and mode in (None, r["mode"])]
    if len(records) != 1:
        wanted = f"{monitor or 'any metric'}" + (f" (mode {mode})" if mode else "")
        recorded = ", ".join(f"{r['monitor']} (mode {r['mode']})" for r in _rankings(meta)) or "none"
        problem = "no best checkpoint by" if not records else "more than one ranking by"
        raise ValueError(
            f"ckpt_path best: {newest} records {problem} {wanted}; it records: {recorded} "
            "(set checkpoint.monitor and checkpoint.mode as in the run that wrote it)"
        )
    (record,) = records
    # By name in this folder, not the recorded absolute path: a run folder that was moved or copied
    # still finds its own checkpoint.
    best = folder / Path(record["best_model_path"]).name
    if not (best / META_FILE).is_file():
        raise FileNotFoundError(
            f"ckpt_path best: {newest.name} records {best.name} as the best by {record['monitor']}, "
            f"but {best} is gone or incomplete (deleted, or checkpoint.save_top_k 0?)"
        )
    if not _is_the_run_s_own(best, record):
        raise FileNotFoundError(
            f"ckpt_path best: {newest.name} records {record['best_model_path']} as the best by {record['monitor']} "
            f"({record['score']:.6g}), but {best} is another run's checkpoint of that name (its own record lists no "
            "such path and score); give a checkpoint path"
        )
    return BestCheckpoint(best, record["monitor"], record["mode"], record["score"], newest)


def _is_the_run_s_own(best: Path, record: dict[str, Any]) -> bool:
    """Whether ``best`` is the checkpoint ``record`` names: its own record, written as it was saved, lists
    itself among the top k by the very path (where its run saved it) and score that ``record`` names."""
    try:
        own = json.loads((best / META_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    for state in _rankings(own):
        if (state["monitor"], state["mode"]) == (record["monitor"], record["mode"]):
            return state["top_k"].get(record["best_model_path"]) == record["score"]
    return False


def _record_holder(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint whose ModelCheckpoint record counts, and its meta: ``last.ckpt`` (the folder's run, what
    ``--ckpt_path last`` resumes) when complete, else the newest checkpoint (``checkpoint.save_last`` off)."""
    last = folder / LAST_FILE
    try:
        return last, json.loads((last / META_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return _newest_checkpoint(folder)


def _newest_checkpoint(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The complete checkpoint with the most training steps (the later write on a tie) and its meta."""
    found = []
    for path in sorted(folder.glob("*.ckpt")) if folder.is_dir() else []:
        meta_file = path / META_FILE
        if not meta_file.is_file():
            continue  # a link whose folder is gone, or a save that never finished
        try:
            meta = json.loads(meta_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # loading it would fail too, with its own message; the record is elsewhere
        found.append(((meta.get("global_step", -1), meta_file.stat().st_mtime_ns, path.name), path, meta))
    if not found:
        raise FileNotFoundError(f"ckpt_path best: no checkpoint in {folder}; train with `python -m app fit` first")
    _, path, meta = max(found, key=lambda item: item[0])
    return path, meta


def _rankings(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The ModelCheckpoint states in ``meta`` that rank by a metric and have named a best checkpoint."""
    rankings = []
    for key, state in (meta.get("callbacks") or {}).items():
        if not key.startswith(_RECORD_PREFIX) or not isinstance(state, dict):
            continue
        monitor, path = state.get("monitor"), state.get("best_model_path")
        score = from_json_data(state.get("best_model_score"))
        mode = _mode_in_state_key(key, monitor)
        if monitor is None or not path or score is None or mode is None:
            continue  # no metric (checkpoints every N steps), or no validation yet
        top_k = {key: float(from_json_data(value)) for key, value in (state.get("best_k_models") or {}).items()}
        rankings.append({"monitor": monitor, "mode": mode, "best_model_path": path, "score": float(score), "top_k": top_k})
    return rankings


def _mode_in_state_key(key: str, monitor: str | None) -> str | None:
    # ModelCheckpoint.state_key is f"ModelCheckpoint{dict(monitor=..., mode=..., ...)!r}"; its state
    # itself holds the monitor but not the mode.
    prefix = f"{_RECORD_PREFIX}'monitor': {monitor!r}, 'mode': "
    if not key.startswith(prefix):
        return None
    rest = key[len(prefix) :]
    return next((mode for mode in ("max", "min") if rest.startswith(repr(mode))), None)
