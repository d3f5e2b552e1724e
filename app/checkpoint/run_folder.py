"""Runs never mix in one run folder: which folder a ``fit`` writes, what ``--ckpt_path last`` is, and
where ``predict`` puts its predictions.

Lightning's ModelCheckpoint never overwrites a file it did not write in this run: a second run into a
checkpoint folder writes ``last-v1.ckpt`` beside ``last.ckpt``, and Lightning's ``last`` is the
newest ``last*.ckpt`` by time, so a later ``--ckpt_path last`` or ``runs/demo/checkpoints/last.ckpt``
reads whichever run happened to write last. Here instead:

- a ``fit`` that does not continue the run of its folder (no ``--ckpt_path``, or a checkpoint outside
  the folder: a fine-tune or a restart from another run) into a folder whose checkpoint folder holds
  another run's complete checkpoint starts a new run folder ``<root>-2`` (``-3``, ...: the first with
  none), and says so in one line; with ``checkpoint.dirpath`` set by the user it is refused (a folder
  the user chose cannot be renamed);
- ``--ckpt_path last`` is exactly ``<checkpoint folder>/last.ckpt``;
- ``predict`` from a checkpoint in a run's ``checkpoints/`` writes into that run's folder.

Every rank of a job must write the same folder. Under Lightning's launcher the launching process
decides while parsing the command line and the ranks it starts inherit the decision through
``RUN_FOLDER_VARIABLE``; under torchrun or SLURM every rank parses the same command line and reads the
same files before any of them writes (nothing is written before the rendezvous), and the strategy
checks after the rendezvous that they agree (:func:`check_every_rank_has`).
"""

from __future__ import annotations

import json
import os
from itertools import count
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from app.checkpoint.checksums import DamagedCheckpointError
from app.checkpoint.format import META_FILE
from app.checkpoint.format import read as read_checkpoint

CHECKPOINTS_FOLDER = "checkpoints"  # <default_root_dir>/checkpoints: the checkpoint group's folder unless dirpath is set
LAST = "last"  # the ckpt_path value resolved here
LAST_FILE = "last.ckpt"  # ModelCheckpoint's CHECKPOINT_NAME_LAST + FILE_EXTENSION
# The launching process's decision, for the ranks Lightning's launcher starts: JSON {"pid", "asked", "root"}.
RUN_FOLDER_VARIABLE = "APP_RUN_FOLDER"
_CONTINUES_THE_FOLDER = (LAST, "best")  # ckpt_path values naming a checkpoint of the folder's own run ("best": best.py's BEST)


def fit_run_folder(root: str, checkpoint_dir: str | None, ckpt_path: str | None, saves_checkpoints: bool = True) -> str:
    """The ``trainer.default_root_dir`` a ``fit`` writes: ``root``, or ``<root>-N`` when ``root``'s
    checkpoint folder holds another run's checkpoint and this fit, which saves checkpoints, does not
    continue that run.

    ``checkpoint_dir``: ``checkpoint.dirpath`` as the user set it (None: ``<root>/checkpoints``).
    Raises ValueError when the user's ``checkpoint.dirpath`` holds another run's checkpoint.
    """
    inherited = _launcher_decision(root)
    if inherited is not None:
        return inherited
    chosen = _choose(root, checkpoint_dir, ckpt_path) if saves_checkpoints else root
    # Lightning's launcher starts the other local ranks with this process's environment, after the parse.
    os.environ[RUN_FOLDER_VARIABLE] = json.dumps({"pid": os.getpid(), "asked": root, "root": chosen})
    return chosen


def _choose(root: str, checkpoint_dir: str | None, ckpt_path: str | None) -> str:
    folder = Path(checkpoint_dir or os.path.join(root, CHECKPOINTS_FOLDER))
    if _continues(ckpt_path, [Path(root), folder]):
        return root
    held = complete_checkpoint_in(folder)
    if held is None:
        return root
    if checkpoint_dir is not None:
        raise ValueError(
            f"checkpoint.dirpath = {checkpoint_dir} holds another run's checkpoint ({held}) and this fit does not "
            f"continue it: continue that run with --ckpt_path {LAST}, or set another checkpoint.dirpath (unset: a "
            "new run folder is chosen)"
        )
    base = os.path.normpath(root)
    chosen = next(f"{base}-{n}" for n in count(2) if complete_checkpoint_in(Path(f"{base}-{n}", CHECKPOINTS_FOLDER)) is None)
    rank_zero_info(
        f"run folder {root} holds another run's checkpoint ({held}): this fit writes into {chosen} "
        f"(to continue the run in {root} instead, give --ckpt_path {LAST}; to continue this one later, "
        f"--trainer.default_root_dir {chosen} --ckpt_path {LAST})"
    )
    return chosen


def _continues(ckpt_path: str | None, folders: list[Path]) -> bool:
    """Whether ``ckpt_path`` names a checkpoint of the run in ``folders`` (the run folder, its checkpoint folder)."""
    if ckpt_path is None:
        return False
    if ckpt_path in _CONTINUES_THE_FOLDER:
        return True
    # As written (a link such as last.ckpt is not followed), and with every link followed.
    for path, resolve in ((Path(os.path.abspath(ckpt_path)), os.path.abspath), (Path(ckpt_path).resolve(), os.path.realpath)):
        if any(path.is_relative_to(resolve(folder)) for folder in folders):
            return True
    return False


def complete_checkpoint_in(folder: Path) -> Path | None:
    """A complete checkpoint in ``folder`` (``last.ckpt`` first), or None: a folder with its ``meta.json``
    (app/checkpoint/format.py), or a plain Lightning checkpoint file."""
    names = sorted(p.name for p in folder.glob("*.ckpt")) if folder.is_dir() else []
    for name in sorted(names, key=lambda name: name != LAST_FILE):
        path = folder / name
        if (path / META_FILE).is_file() or path.is_file():
            return path
    return None


def _launcher_decision(root: str) -> str | None:
    """The folder the process that started this one chose for ``root`` (Lightning's launcher: this process's
    parent, parsing the same command line); None elsewhere: a first process, torchrun's or SLURM's ranks,
    or a variable left by an earlier run.

    A rank the launcher started has ``LOCAL_RANK`` > 0 in its environment (Lightning's subprocess launcher
    sets it); without that test, a process started by one that parsed a ``fit`` in-process and launched
    no ranks (a notebook, a test runner) would take that stale choice as its own while its ranks chose
    for themselves."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return None
    try:
        decision = json.loads(os.environ.get(RUN_FOLDER_VARIABLE, ""))
    except json.JSONDecodeError:
        return None
    if not isinstance(decision, dict) or decision.get("pid") != os.getppid() or decision.get("asked") != root:
        return None
    return str(decision["root"])


def check_every_rank_has(folders: list[Path]) -> None:
    """Raises the same ValueError on every rank when the ranks chose different run folders (``folders``: this
    rank's, as the lock takes them); collective over the default process group, after the rendezvous."""
    os.environ.pop(RUN_FOLDER_VARIABLE, None)  # every local rank has started: the decision is spent
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = [str(folder) for folder in folders]
    every_rank: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, mine)
    if all(theirs == every_rank[0] for theirs in every_rank):
        return
    chosen = "; ".join(f"rank {rank}: {', '.join(theirs or [])}" for rank, theirs in enumerate(every_rank))
    raise ValueError(
        f"the ranks chose different run folders ({chosen}): a checkpoint appeared in the folder while they started "
        "(another job writing there?); start the job again, or set trainer.default_root_dir to a folder of its own"
    )


def last_checkpoint(checkpoint_dir: str, fitting: bool) -> str | None:
    """``--ckpt_path last`` as a path: exactly ``<checkpoint_dir>/last.ckpt`` (never another run's
    ``last-v1.ckpt``, which Lightning's own ``last`` may pick by time).

    Without one, ``fit`` starts from scratch with a warning (None: a first start, so that the same
    command line serves the first start and every restart); other commands raise FileNotFoundError.
    """
    last = Path(checkpoint_dir) / LAST_FILE
    # lexists: a link to a folder that is gone is an error when it is read, not a reason to start afresh.
    if os.path.lexists(last):
        return _intact_or_newest_intact(last)
    if not fitting:
        raise FileNotFoundError(f"ckpt_path {LAST}: there is no {last}; give a checkpoint's path, or train with fit first")
    rank_zero_warn(f"ckpt_path {LAST}: there is no {last} yet, so fit starts from scratch (a first start)")
    return None


def _intact_or_newest_intact(last: Path) -> str:
    """``last`` unless a checksum shows it damaged; then the newest intact checkpoint beside it, with a
    warning naming both (never a damaged one: a FileNotFoundError when none is intact). Other faults
    (an incomplete or missing folder) are left to the load, which names them."""
    try:
        read_checkpoint(last)
        return str(last)
    except DamagedCheckpointError as damage:
        reason = str(damage)
    except ValueError:
        return str(last)
    others = [p for p in last.parent.glob("*.ckpt") if p.name != last.name and p.resolve() != last.resolve()]
    for candidate in sorted(others, key=lambda p: p.resolve().stat().st_mtime if p.exists() else 0, reverse=True):
        try:
            read_checkpoint(candidate)
        except ValueError:
            continue
        rank_zero_warn(f"{reason}; {LAST} falls back to {candidate}, the newest intact checkpoint of the run")
        return str(candidate)
    raise FileNotFoundError(f"{reason}, and no other checkpoint in {last.parent} is intact")


def checkpoint_run_folder(ckpt_path: str | None) -> str | None:
    """The run folder a checkpoint belongs to: ``X`` for ``X/checkpoints/NAME``; None for any other path
    (an exported file, a checkpoint folder the user named)."""
    if ckpt_path is None:
        return None
    path = Path(os.path.normpath(ckpt_path))  # as written (relative stays relative): last.ckpt is a link into the same folder
    return str(path.parent.parent) if path.parent.name == CHECKPOINTS_FOLDER else None
