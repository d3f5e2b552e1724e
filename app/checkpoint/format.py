"""The on-disk checkpoint format: writing, atomically publishing, validating and reading a checkpoint.

A checkpoint named ``NAME`` (``last.ckpt``, ``epoch=1-step=80.ckpt``) is a symbolic link to a
folder ``.NAME.<token>`` beside it, which holds:

    .metadata, __<rank>_0.distcp   every rank's shards of the model and optimizer state (DCP)
    writer.json                    who writes it (host, pid, SLURM job), written first, by rank 0
    vocabulary/                    data.frequency_threshold's vocabulary, when the run had one
                                   (app/checkpoint/vocabulary.py)
    meta.json                      plain data: loops, callbacks, hyper-parameters, the sharding
                                   plan, world size, versions, the CRC-32 of every shard file
                                   (app/checkpoint/checksums.py); written last, by rank 0, so that
                                   its presence marks the folder complete

Publishing a new checkpoint under an existing name writes a fresh folder and swaps the link with
one ``rename`` (atomic on POSIX): a reader sees either the old complete checkpoint or the new one,
never none, and a crash at any point leaves the previous checkpoint in place. Then rank 0 deletes the
folders of that name the link no longer points at (the previous checkpoint, saves that crashed), but
not an unfinished one whose writer still runs on this host: another job's save in progress (a run
folder has one job at a time, app/checkpoint/run_lock.py; this is the second line of defence). A plain folder with
the same content (a copy made with ``cp -rL``) loads as well.

Safe loading: nothing is unpickled as code. meta.json is JSON; DCP's shard files are read with
``torch.load(weights_only=True)`` by DCP itself; DCP's ``.metadata`` index is a pickle, read here
with an unpickler that admits only DCP's own metadata classes (DCP has no safe reader of its own).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torchrec.distributed.types import ShardingPlan

from app.checkpoint.checksums import ChecksummingFileSystemWriter, verify_checksums
from app.checkpoint.plan_json import plan_from_json, plan_to_json
from app.checkpoint.reshard import load_resharded
from app.checkpoint.vocabulary import load_vocabulary, save_vocabulary, trained_threshold
from app.data.lock_file import Holder, read_holder

META_FILE = "meta.json"  # written last: a folder without it is incomplete
CHECKSUMS_KEY = "shard_checksums"  # meta.json's record of each shard file's CRC-32 and size
WRITER_FILE = "writer.json"  # written first: whose save an incomplete folder is
DCP_INDEX_FILE = ".metadata"
FORMAT_VERSION = 1
_TENSOR_KEYS = ("state_dict", "optimizer_states")  # what goes through DCP; everything else is meta.json


class Collectives(Protocol):
    """What saving needs from the strategy: rank 0 decides, every rank follows."""

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...

    def barrier(self, name: str | None = None) -> None: ...

    @property
    def checkpoint_process_group(self) -> dist.ProcessGroup | None:
        """The group DCP's collectives go through (None: the default group, or no group at all)."""


@dataclass
class CheckpointInfo:
    """What rank 0 read and checked in a checkpoint before any rank loads its shards."""

    path: str  # the folder holding the files (the link resolved)
    meta: dict[str, Any]  # Lightning's checkpoint dict without its tensors, plus the fields below
    sharding_plan: ShardingPlan
    world_size: int
    index: Metadata  # DCP's index of the saved tensors: their names and shapes

    @property
    def global_step(self) -> int | None:
        """Lightning's count of training updates when it was saved."""
        step = self.meta.get("global_step")
        return None if step is None else int(step)


# ---- writing ---------------------------------------------------------------------------------


class CheckpointNotWritableError(ValueError):
    """A checkpoint could not be written into its folder (permissions, a read-only or full disk); raised on
    every rank alike, the previous checkpoints untouched."""


def save(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    collectives: Collectives,
    plan: ShardingPlan,
    world_size: int,
    checksums: bool = True,
) -> None:
    """Writes Lightning's ``checkpoint`` dict to ``path`` from every rank and publishes it atomically; with
    ``checksums``, meta.json records the CRC-32 of every file DCP wrote (app/checkpoint/checksums.py)."""
    link = Path(collectives.broadcast(str(path)))
    token = collectives.broadcast(uuid.uuid4().hex[:12])
    folder = link.parent / f".{link.name}.{token}"
    # After each step that writes, every rank learns whether any rank could not write (a folder turned
    # read-only, a full disk): all stop with the same line, none is left waiting at a barrier.
    _on_every_rank(collectives, link, lambda: _start_folder(folder) if collectives.is_global_zero else None)
    tensors = {key: checkpoint[key] for key in _TENSOR_KEYS if key in checkpoint}
    # dcp.save gathers every rank's result: a failure on one rank raises on all, no rank hangs.
    # Its collectives go through the strategy's checkpoint group: ranks that finish writing first
    # wait there for the slowest (uneven shards), not under the NCCL watchdog's timeout.
    # The checksumming writer hashes the bytes as it writes them and hands each rank's checksums to rank 0
    # inside the results DCP gathers there.
    writer = ChecksummingFileSystemWriter(folder) if checksums else dcp.FileSystemWriter(folder)
    try:
        dcp.save(tensors, storage_writer=writer, process_group=collectives.checkpoint_process_group)
    except dcp.CheckpointException as error:  # every rank has it: DCP gathers each rank's result
        disk_errors = [failure for failure, _ in error.failures.values() if isinstance(failure, OSError)]
        if not disk_errors:
            raise
        raise CheckpointNotWritableError(_not_writable(link, disk_errors[0])) from error
    # Every rank's shards are on disk (dcp.save returns after its gather): rank 0 completes the folder and
    # publishes it.
    if collectives.is_global_zero:
        meta = {key: value for key, value in checkpoint.items() if key not in _TENSOR_KEYS}
        meta.update(tensor_keys=sorted(tensors), sharding_plan=plan_to_json(plan), world_size=world_size)
        meta.update(format_version=FORMAT_VERSION, versions=_library_versions())
        if isinstance(writer, ChecksummingFileSystemWriter):
            assert writer.recorded is not None, "rank 0 is DCP's coordinator: it receives every rank's checksums"
            meta[CHECKSUMS_KEY] = writer.recorded
        _on_every_rank(collectives, link, lambda: _finish_folder(meta, folder, link))
    else:
        _on_every_rank(collectives, link, lambda: None)


def _start_folder(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / WRITER_FILE).write_text(json.dumps(asdict(Holder.of_this_process()), indent=1) + "\n")


def _finish_folder(meta: dict[str, Any], folder: Path, link: Path) -> None:
    meta = save_vocabulary(meta, folder)  # its arrays as files beside meta.json, a reference in it
    _write_file_durably(folder / META_FILE, json.dumps(to_json_data(meta), indent=1).encode())
    _publish(folder, link)


def _on_every_rank(collectives: Collectives, link: Path, write: Callable[[], None]) -> None:
    """Runs ``write`` on this rank, then raises CheckpointNotWritableError on every rank if it failed on any."""
    try:
        write()
        failure = None
    except OSError as error:
        failure = _not_writable(link, error)
    if dist.is_initialized():
        failures: list[str | None] = [None] * dist.get_world_size(collectives.checkpoint_process_group)
        dist.all_gather_object(failures, failure, group=collectives.checkpoint_process_group)
    else:
        failures = [failure]
        collectives.barrier()
    failure = next((line for line in failures if line is not None), None)
    if failure is not None:
        raise CheckpointNotWritableError(failure)


def _not_writable(link: Path, error: OSError) -> str:
    """The line for a save that could not write: the folder, the system's reason, the checkpoint still there."""
    previous = [path for path in link.parent.glob("*.ckpt") if path.exists()] if link.parent.is_dir() else []
    newest = max(previous, key=lambda path: path.stat().st_mtime, default=None)
    kept = f"the newest checkpoint there, {newest}, is intact" if newest is not None else "no checkpoint was saved there before"
    reason = f"{error.strerror}: {error.filename}" if error.strerror and error.filename else str(error)
    return f"checkpoint folder {link.parent} is not writable ({reason}); {kept}"


def _write_file_durably(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(folder: Path, link: Path) -> None:
    """Points ``link`` at ``folder`` in one rename, then removes what the link pointed at before."""
    new_link = link.with_name(f".{link.name}.link-{folder.name.rsplit('.', 1)[-1]}")
    os.symlink(folder.name, new_link)
    if link.is_dir() and not link.is_symlink():
        # A plain folder (the layout before links) cannot be replaced by a rename: move it aside.
        link.rename(link.with_name(f".{link.name}.replaced-{folder.name.rsplit('.', 1)[-1]}"))
    os.replace(new_link, link)
    _fsync_folder(link.parent)
    _remove_unlinked_folders(link)


def _remove_unlinked_folders(link: Path) -> None:
    # Folders of ``link``'s name it no longer points at: the previous checkpoint, and any left by a
    # save that crashed before it published.
    # Runs after the new checkpoint is published: a folder that cannot be removed now (on NFS, a file
    # another client still holds open becomes a ``.nfs*`` file that rmtree cannot delete) is left for the
    # next save's pass, never failing a save that has already succeeded.
    current = os.readlink(link) if link.is_symlink() else None
    for folder in link.parent.glob(f".{_glob_escape(link.name)}.*"):
        if folder.name == current or _written_by_another_live_process(folder):
            continue
        try:
            shutil.rmtree(folder) if folder.is_dir() and not folder.is_symlink() else folder.unlink()
        except OSError as error:
            warnings.warn(f"could not remove the old checkpoint folder {folder} ({error}); the next save retries", stacklevel=2)


def _written_by_another_live_process(folder: Path) -> bool:
    """An unfinished checkpoint folder whose writer runs on this host and is not this process: another
    job's save in progress. A writer on another host cannot be probed: its folder is deleted (the run
    folder's lock keeps other jobs out; a save of this job that crashed looks the same)."""
    if not folder.is_dir() or (folder / META_FILE).exists():
        return False
    writer = read_holder(folder / WRITER_FILE)
    me = Holder.of_this_process()
    return writer is not None and writer.host == me.host and not writer.is_this_process(me) and not writer.is_gone(me)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove(path: str | os.PathLike) -> None:
    """Removes a checkpoint: its link and the folder it points at (call on one rank)."""
    link = Path(path)
    if link.is_symlink():
        link.unlink()
        _remove_unlinked_folders(link)
    elif link.is_dir():
        shutil.rmtree(link)
    elif link.exists():
        link.unlink()


def _library_versions() -> dict[str, str]:
    import lightning
    import torchrec

    return {"torch": torch.__version__, "torchrec": torchrec.__version__, "lightning": lightning.__version__}


# ---- plain data --------------------------------------------------------------------------------
# Lightning's checkpoint dict holds a few tensors outside the model (ModelCheckpoint's scores) and
# dicts with non-string keys; JSON holds neither, so both are tagged.


def to_json_data(value: Any, where: str = "checkpoint") -> Any:
    """``value`` as str/int/float/bool/None/list/dict data; tensors and non-string keys tagged."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        return {"__tensor__": {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                               "values": tensor.flatten().tolist()}}  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [to_json_data(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {key: to_json_data(item, f"{where}.{key}") for key, item in value.items()}
        return {"__items__": [[to_json_data(k, where), to_json_data(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise ValueError(f"{where}: a {type(value).__name__} cannot be stored in a checkpoint's {META_FILE}")


def from_json_data(value: Any) -> Any:
    """The inverse of :func:`to_json_data` (tuples come back as lists)."""
    if isinstance(value, list):
        return [from_json_data(item) for item in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"__tensor__"}:
        spec = value["__tensor__"]
        return torch.tensor(spec["values"], dtype=getattr(torch, spec["dtype"])).reshape(spec["shape"])
    if set(value) == {"__items__"}:
        return {_hashable(from_json_data(k)): from_json_data(v) for k, v in value["__items__"]}
    return {key: from_json_data(item) for key, item in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


# ---- reading and checking ---------------------------------------------------------------------


def read(path: str | os.PathLike, module: nn.Module | None = None) -> CheckpointInfo:
    """Reads ``path``'s metadata and checks that the checkpoint is complete and, given the unsharded
    ``module``, that it fits it. Raises ValueError naming the path and what is wrong."""
    link = Path(path)
    if not link.exists():
        broken = " (a link to a folder that is gone)" if link.is_symlink() else ""
        raise ValueError(f"ckpt_path {path}: no such checkpoint{broken}")
    folder = link.resolve()
    if not folder.is_dir() or not (folder / META_FILE).is_file():
        what = "a file" if folder.is_file() else "a folder without " + META_FILE
        raise ValueError(
            f"ckpt_path {path}: not a complete checkpoint of this app ({what}); "
            "checkpoints are folders written by `python -m app fit`"
        )
    try:
        meta = from_json_data(json.loads((folder / META_FILE).read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"ckpt_path {path}: {META_FILE} is truncated or corrupted ({error})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version")
        raise ValueError(f"ckpt_path {path}: checkpoint format {found!r}, this app reads format {FORMAT_VERSION}")
    meta = load_vocabulary(meta, folder, path)
    index = _read_dcp_index(path, folder)
    _check_shard_files(path, folder, index)
    verify_checksums(path, folder, meta.get(CHECKSUMS_KEY))  # before any weight is used
    if module is not None:
        check_fits_model(path, index, meta, module)
    return CheckpointInfo(
        path=str(folder), meta=meta, sharding_plan=plan_from_json(meta["sharding_plan"]), world_size=meta["world_size"],
        index=index,
    )


class _DcpIndexUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses and torch's dtype/layout/Size: nothing that runs code."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _SAFE_TORCH_TYPES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


_SAFE_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


def _read_dcp_index(path: str | os.PathLike, folder: Path) -> Metadata:
    try:
        with open(folder / DCP_INDEX_FILE, "rb") as f:
            return _DcpIndexUnpickler(f).load()
    except FileNotFoundError:
        raise ValueError(f"ckpt_path {path}: {DCP_INDEX_FILE} (the shard index) is missing") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
        raise ValueError(f"ckpt_path {path}: {DCP_INDEX_FILE} (the shard index) is unreadable ({error})") from None


def _check_shard_files(path: str | os.PathLike, folder: Path, index: Metadata) -> None:
    needed_bytes: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        end = info.offset + info.length
        needed_bytes[info.relative_path] = max(needed_bytes.get(info.relative_path, 0), end)
    for name, size in sorted(needed_bytes.items()):
        shard = folder / name
        if not shard.is_file():
            raise ValueError(f"ckpt_path {path}: shard file {name} is missing (incomplete copy?)")
        if shard.stat().st_size < size:
            found_bytes = shard.stat().st_size
            raise ValueError(f"ckpt_path {path}: shard file {name} is truncated ({found_bytes} of {size} bytes)")


def check_fits_model(path: str | os.PathLike, index: Metadata, meta: dict[str, Any], module: nn.Module) -> None:
    """Raises ValueError when the checkpoint's model tensors differ from ``module``'s in names or shapes."""
    saved = {
        key.removeprefix("state_dict."): list(entry.size)
        for key, entry in index.state_dict_metadata.items()
        if key.startswith("state_dict.") and isinstance(entry, TensorStorageMetadata)
    }
    here = {key: list(value.shape) for key, value in module.state_dict().items() if isinstance(value, torch.Tensor)}
    both = sorted(saved.keys() & here.keys())
    problems = [f"{key} is {saved[key]} there, {here[key]} here" for key in both if saved[key] != here[key]]
    problems += [f"{key} only there" for key in sorted(saved.keys() - here.keys())]
    problems += [f"{key} only here" for key in sorted(here.keys() - saved.keys())]
    if not problems:
        return
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    hparams = _differing_hyper_parameters(meta.get("hyper_parameters") or {}, getattr(module, "hparams", {}))
    if threshold := trained_threshold(meta):  # table sizes there follow its vocabulary
        hparams += f" (it was trained with data.frequency_threshold = {threshold}: its tables have that vocabulary's sizes + 2)"
    raise ValueError(f"ckpt_path {path} does not fit this model: {shown}{hparams}")


def _differing_hyper_parameters(saved: dict[str, Any], here: Any) -> str:
    differing = [
        f"model.{key}: {saved[key]!r} there, {here[key]!r} here"
        for key in sorted(saved)
        if key in here and from_json_data(to_json_data(here[key])) != saved[key]
    ]
    return (" (hyper-parameters that differ: " + "; ".join(differing) + ")") if differing else ""


# ---- loading -------------------------------------------------------------------------------------


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the index read by :class:`_DcpIndexUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / DCP_INDEX_FILE, "rb") as f:
            metadata = _DcpIndexUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_sharded_state(
    info: CheckpointInfo,
    module: nn.Module,
    optimizers: list[Any],
    current_plan: ShardingPlan | None,
    process_group: Any = None,
) -> None:
    """Loads the DCP tensors of the checkpoint ``info`` describes into the sharded ``module`` and its
    ``optimizers``.

    Every rank reads the pieces of the saved shards that overlap its own. ``info.sharding_plan`` is the
    plan the checkpoint was written under, ``current_plan`` the one ``module`` is sharded with;
    ``process_group`` carries DCP's collectives (None: the default group).
    """
    assert current_plan is not None
    checkpoint_dir, saved_plan = info.path, info.sharding_plan
    if _plan_json_by_rank(saved_plan) != _plan_json_by_rank(current_plan):
        # The fused optimizer's state keys and shapes follow the plan (torchrec#2394): app/checkpoint/reshard.py maps them.
        load_resharded(
            checkpoint_dir, module, optimizers, saved_plan, current_plan, lambda: SafeFileSystemReader(checkpoint_dir),
            process_group=process_group,
        )
    else:
        tensors: dict[str, Any] = {"state_dict": module.state_dict()}
        # Plain SGD keeps no tensors (no momentum): its checkpoint then has no optimizer entries for DCP to load.
        if optimizers and any(key.startswith("optimizer_states") for key in info.index.state_dict_metadata):
            for optimizer in optimizers:
                optimizer.init_state()  # fused optimizer state is lazy: give DCP tensors to load into
            tensors["optimizer_states"] = [optimizer.state_dict() for optimizer in optimizers]
        dcp.load(tensors, storage_reader=SafeFileSystemReader(checkpoint_dir), process_group=process_group)
        module.load_state_dict(tensors["state_dict"])
        for optimizer, state in zip(optimizers, tensors.get("optimizer_states", [])):
            optimizer.load_state_dict(state)
    restore_fused_optimizer_step(info.global_step, optimizers)


def restore_fused_optimizer_step(step: int | None, optimizers: list[Any]) -> None:
    """Sets the step count of FBGEMM's fused embedding optimizers to the checkpoint's ``global_step``.

    FBGEMM's Adam takes its bias correction (1 - beta ** step) from the kernel's ``iter`` buffer, which
    is in neither the module's nor the optimizer's state dict (TorchRec keeps the kernels out of the
    module tree and its fused optimizer exposes only the moments), so a resumed run would start the
    correction over at step 1. TorchRec offers the setter, not a getter: ``set_optimizer_step`` on its
    keyed optimizers reaches every kernel. The count set is Lightning's ``global_step``, the number
    of training updates (one per batch; ``trainer.accumulate_grad_batches`` other than 1 is refused).
    FBGEMM itself advances ``iter`` at every forward of the kernel, evaluation batches included; the
    module puts the count back after each validation (app/train/fused_step_count.py), so it is the
    training steps in the run that wrote the checkpoint too. FBGEMM copies ``iter`` into the count
    it computes with at the first forward after construction, which is the first forward after a resume.
    """
    if not optimizers or step is None:
        return
    for optimizer in optimizers:
        if hasattr(optimizer, "set_optimizer_step"):
            optimizer.set_optimizer_step(int(step))



def _plan_json_by_rank(plan: ShardingPlan) -> dict[str, Any]:
    """The plan's JSON with each placement cut to its rank (``rank:1/cuda:1`` -> ``rank:1``).

    The strategy points a saved plan's placements at the devices of the run that loads it
    (app/distributed/placements.py); what DCP reads does not depend on the device, so a plan that
    differs from the saved one in its devices only loads as it is, without resharding.
    """
    data = plan_to_json(plan)  # a fresh dict: changed in place
    for parameters in data["modules"].values():
        for parameter in parameters.values():
            for shard in parameter["shards"] or []:
                if shard["placement"] is not None:
                    shard["placement"] = shard["placement"].split("/")[0]
    return data
