"""``python -m app.data.preprocess``: raw TSV -> NumPy days -> batches equal to reading the TSV directly.

Also: metadata values computed independently, gzip input, resuming after a lost day, the frequency
threshold's contiguous ids, vocabulary reuse, and bad inputs reported with the file's name.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data import preprocess
from app.data import tsv
from app.data.batches import make_batch
from app.data.numpy_days import NumpyDaysSource
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import CriteoArrays, read_tsv

REPO = Path(__file__).resolve().parents[2]
REAL_DIR = Path(__file__).resolve().parents[3] / "shared/data/criteo"
REAL_FILES = ("terabyte_day0_10k.tsv", "kaggle_train_4571.tsv")
RAW = [2**32] * 26
SIZES = [3, 7, 10, 97, 100, 1_000, 4_096, 10_000, 65_537, 10**6] * 2 + [2, 5, 11, 13, 40_000_000, 2**31]


def run_main(inputs: list[Path], output: Path, *options: str) -> int:
    argv = ["--input", json.dumps(list(map(str, inputs))), "--output", str(output), "--workers", "1", "--progress", "false", *options]
    return preprocess.main(argv)


def synthetic_files(folder: Path, rows: tuple[int, ...], seed: int = 500) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i, num_rows in enumerate(rows):
        files.append(folder / f"part_{i}.tsv")
        write_synthetic_criteo(files[-1], num_rows=num_rows, seed=seed + i)
    return files


def assert_round_trip(output: Path, files: list[Path], sizes: list[int]) -> None:
    """Every row through NumpyDaysSource -> make_batch equals read_tsv -> make_batch, exactly."""
    source = NumpyDaysSource.from_directory(output, None, sizes)
    expected = CriteoArrays.concat([read_tsv(path, sizes) for path in files])
    assert len(source) == len(expected)
    rows = np.arange(len(source))
    got, want = make_batch(source.take(rows), rows), make_batch(expected.take(rows), rows)
    for name in ("dense_features", "labels", "row_ids"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.sparse_features.values(), want.sparse_features.values())
    assert torch.equal(got.sparse_features.lengths(), want.sparse_features.lengths())


def test_synthetic_round_trip_and_exact_metadata(tmp_path, capsys) -> None:
    files = synthetic_files(tmp_path / "raw", (6_000, 900))
    assert files[0].stat().st_size > 1 << 20  # several 1 MiB chunks per day, appended to the files
    out = tmp_path / "out"
    assert run_main(files, out, "--block_mib", "1") == 0
    assert "rows/s per worker" in capsys.readouterr().out
    assert_round_trip(out, files, SIZES)
    # file layout: TorchRec's dtypes and shapes
    assert np.load(out / "day_1_dense.npy").shape == (900, 13)
    assert np.load(out / "day_1_sparse.npy").dtype == np.int32  # raw 32-bit ids, as their bits
    labels = np.load(out / "day_1_labels.npy")
    assert labels.dtype == np.int32 and labels.shape == (900, 1)
    check_metadata(out, files)


def check_metadata(out: Path, files: list[Path]) -> None:
    """metadata.json against values computed here from the TSV reader."""
    metadata = json.loads((out / "metadata.json").read_text())
    parsed = [read_tsv(path, RAW) for path in files]
    for day, (entry, arrays) in enumerate(zip(metadata["days"], parsed)):
        assert entry["day"] == day and entry["input"] == files[day].name
        assert entry["input_bytes"] == files[day].stat().st_size
        assert entry["rows"] == len(arrays)
        assert entry["positives"] == int((arrays.labels == 1).sum())
        assert entry["positive_rate"] == pytest.approx(float((arrays.labels == 1).mean()))
        assert entry["distinct_ids_per_feature"] == [np.unique(arrays.sparse[:, j]).size for j in range(26)]
    everything = CriteoArrays.concat(parsed)
    assert metadata["total_rows"] == len(everything)
    assert metadata["positives"] == int((everything.labels == 1).sum())
    assert metadata["distinct_ids_per_feature"] == [np.unique(everything.sparse[:, j]).size for j in range(26)]
    assert metadata["dense_transform"] == "log1p" and metadata["frequency_threshold"] == 0
    assert metadata["skipped_rows"] == 0
    assert [i["name"] for i in metadata["inputs"]] == [f.name for f in files]


def test_real_rows_round_trip_in_parallel(tmp_path, capsys) -> None:
    files = [REAL_DIR / name for name in REAL_FILES]
    if not all(path.is_file() for path in files):
        pytest.skip(f"real Criteo rows not found in {REAL_DIR} (a clone without ../shared)")
    out = tmp_path / "real"
    # Two workers: the spawned process pool, with one file each.
    assert run_main(files, out, "--workers", "2") == 0
    assert "(2 workers" in capsys.readouterr().out
    assert_round_trip(out, files, SIZES)
    assert_round_trip(out, files, RAW)  # raw 32-bit ids, unchanged
    check_metadata(out, files)


def test_entry_point_and_gzip(tmp_path) -> None:
    files = synthetic_files(tmp_path / "raw", (400,))
    packed = tmp_path / "raw" / "part_0.tsv.gz"
    packed.write_bytes(gzip.compress(files[0].read_bytes()))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "app.data.preprocess", "--input", str(packed), "--output", str(out), "--workers", "1"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "preprocessed 400 rows" in done.stdout
    assert_round_trip(out, files, SIZES)  # the gzip day equals the plain file's rows


def test_help_documents_every_option(capsys) -> None:
    with pytest.raises(SystemExit):
        preprocess.main(["--help"])
    text = capsys.readouterr().out
    for option in ("--input", "--output", "--workers", "--frequency_threshold", "--vocabulary",
                   "--dense_transform", "--on_bad_rows", "--block_mib", "--progress", "--config"):
        assert option in text


def test_resume_redoes_only_the_lost_day(tmp_path, capsys) -> None:
    files = synthetic_files(tmp_path / "raw", (300, 200, 100))
    out = tmp_path / "out"
    assert run_main(files, out) == 0
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("day_*")}
    for part in ("dense", "sparse", "labels"):
        (out / f"day_1_{part}.npy").unlink()
    (out / "day_0_dense.npy.partial-node7-123").write_bytes(b"left over by a crash")  # ignored: day 0 is complete
    capsys.readouterr()
    assert run_main(files, out) == 0
    log = capsys.readouterr()
    assert "day 0: complete" in log.err and "day 2: complete" in log.err and "day 1:" not in log.err
    assert "preprocessed 200 rows (1 of 3 days; 2 already complete)" in log.out
    for name, mtime in mtimes.items():
        changed = out.joinpath(name).stat().st_mtime_ns != mtime
        assert changed == name.startswith("day_1_"), name
    assert_round_trip(out, files, SIZES)
    check_metadata(out, files)
    assert run_main(files[:2], out) == 0  # fewer inputs: day 2 is left over, and said so
    assert "also holds days [2]" in capsys.readouterr().err
    # A different input for a finished day is refused, not silently mixed in.
    other = synthetic_files(tmp_path / "other", (250,), seed=9)
    other_named = tmp_path / "other" / files[0].name
    other[0].rename(other_named)
    assert run_main([other_named, *files[1:]], out) == 2
    assert "day 0 was made from" in capsys.readouterr().err


def tsv_row(label: int, ids: list[str]) -> str:
    """A labelled row with dense fields 1..13 and the given hex ids (missing ones empty)."""
    ids = ids + [""] * (26 - len(ids))
    return "\t".join([str(label)] + [str(i) for i in range(1, 14)] + ids) + "\n"


def test_frequency_threshold_gives_exact_contiguous_ids(tmp_path) -> None:
    # C1 over two files: 0a x3, 05 x1 + x1 (counts add up across files), ff x1; C2: 10 x5, 20 x1.
    first = tmp_path / "a.tsv"
    second = tmp_path / "b.tsv"
    first.write_text(tsv_row(1, ["0a", "10"]) + tsv_row(0, ["0a", "10"]) + tsv_row(0, ["05", "20"]))
    second.write_text(tsv_row(1, ["0a", "10"]) + tsv_row(0, ["05", "10"]) + tsv_row(1, ["ff", "10"]))
    out = tmp_path / "out"
    assert run_main([first, second], out, "--frequency_threshold", "2") == 0
    # vocabulary C1: sorted raw ids seen >= 2 times: 0x05, 0x0a -> 2, 3; 0xff -> 1 (rare)
    np.testing.assert_array_equal(np.load(out / "vocab_feature_0.npy"), [0x05, 0x0A])
    np.testing.assert_array_equal(np.load(out / "vocab_feature_1.npy"), [0x10])
    np.testing.assert_array_equal(np.load(out / "vocab_feature_2.npy"), [0])  # missing -> raw 0, 6 times
    sparse = np.concatenate([np.load(out / "day_0_sparse.npy"), np.load(out / "day_1_sparse.npy")])
    np.testing.assert_array_equal(sparse[:, 0], [3, 3, 2, 3, 2, 1])
    np.testing.assert_array_equal(sparse[:, 1], [2, 2, 1, 2, 2, 2])
    assert (sparse[:, 2:] == 2).all()
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["frequency_threshold"] == 2 and metadata["sparse_ids"] == "contiguous"
    assert metadata["vocabulary_sizes"][:3] == [2, 1, 1]
    assert metadata["num_embeddings_per_feature"][:3] == [4, 3, 3]
    assert metadata["distinct_ids_per_feature"][:3] == [3, 2, 1]  # raw ids seen, before the threshold
    # The saved vocabulary maps another file the same way; unseen ids -> 1.
    third = tmp_path / "c.tsv"
    third.write_text(tsv_row(0, ["0a", "30"]) + tsv_row(1, ["05", "10"]))
    assert run_main([third], tmp_path / "mapped", "--vocabulary", str(out)) == 0
    mapped = np.load(tmp_path / "mapped" / "day_0_sparse.npy")
    np.testing.assert_array_equal(mapped[:, :2], [[3, 1], [2, 2]])


def test_threshold_resume_reuses_the_vocabulary(tmp_path, capsys) -> None:
    files = synthetic_files(tmp_path / "raw", (200, 100))
    out = tmp_path / "out"
    assert run_main(files, out, "--frequency_threshold", "3") == 0
    first = np.load(out / "day_1_sparse.npy")
    (out / "day_1_sparse.npy").unlink()
    capsys.readouterr()
    assert run_main(files, out, "--frequency_threshold", "3") == 0
    assert "reusing the vocabularies" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(out / "day_1_sparse.npy"), first)
    assert run_main(files, out, "--frequency_threshold", "4") == 2  # other options: refused, nothing overwritten
    assert "vocabulary.json: made with threshold 3" in capsys.readouterr().err
    assert run_main(files, out) == 2  # raw ids into a folder of contiguous days
    assert "made with other options" in capsys.readouterr().err
    np.testing.assert_array_equal(np.load(out / "day_1_sparse.npy"), first)
    # A first pass interrupted after counting day 0: only day 1 is counted again, same vocabulary.
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    task = preprocess.DayTask(0, files[0], resumed, "log1p", "error", 1 << 20, None)
    preprocess.count_ids(task)
    assert run_main(files, resumed, "--frequency_threshold", "3") == 0
    err = capsys.readouterr().err
    assert "day 0: ids already counted" in err and "day 1: ids already counted" not in err
    for j in range(26):
        name = f"vocab_feature_{j}.npy"
        np.testing.assert_array_equal(np.load(resumed / name), np.load(out / name))
    assert not list(resumed.glob("*id_counts*"))  # replaced by the vocabulary


def test_malformed_input_names_file_and_line_and_leaves_no_day(tmp_path, capsys) -> None:
    good = synthetic_files(tmp_path / "raw", (50,))[0]
    bad = tmp_path / "raw" / "bad.tsv"
    lines = good.read_text().splitlines(keepends=True)
    lines[6] = lines[6].replace("\t", "\tx", 1)  # I1 = "x..." on line 7
    bad.write_text("".join(lines))
    out = tmp_path / "out"
    assert run_main([good, bad], out) == 2
    assert f"{bad}:7: field I1" in capsys.readouterr().err
    assert not list(out.glob("day_1_*"))  # no partial day under a final name
    assert not list(out.glob("*.partial*"))  # the aborted day's files under their writer's names too


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), (b"", ":1: file is empty")],
    ids=["missing", "empty"],
)
def test_missing_or_empty_input_is_named(tmp_path, capsys, content, message) -> None:
    path = tmp_path / "input.tsv"
    if content is not None:
        path.write_bytes(content)
    assert run_main([path], tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "input.tsv" in err and message in err


def test_bad_option_values(tmp_path, capsys) -> None:
    files = synthetic_files(tmp_path / "raw", (20,))
    assert run_main(files, tmp_path / "out", "--frequency_threshold", "-1") == 2
    assert "--frequency_threshold -1" in capsys.readouterr().err
    assert run_main(files, tmp_path / "out", "--vocabulary", str(tmp_path / "none")) == 2
    assert "vocabulary.json: missing" in capsys.readouterr().err


def test_skip_and_dense_transform_options(tmp_path, capsys) -> None:
    """Passed through to the TSV reader's streaming API; refused clearly where it does not exist."""
    files = synthetic_files(tmp_path / "raw", (30,))
    lines = files[0].read_text().splitlines(keepends=True)
    lines[3] = "garbage\n"
    files[0].write_text("".join(lines))
    if not hasattr(tsv, "iter_tsv_chunks"):
        assert run_main(files, tmp_path / "out", "--on_bad_rows", "skip") == 2
        assert "has no iter_tsv_chunks" in capsys.readouterr().err
        return
    assert run_main(files, tmp_path / "out", "--on_bad_rows", "skip") == 0
    metadata = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert metadata["skipped_rows"] == 1 and metadata["total_rows"] == 29
    assert metadata["days"][0]["first_skipped_row"].startswith(f"{files[0]}:4: ")
    assert run_main(files, tmp_path / "out3", "--on_bad_rows", "skip", "--dense_transform", "log_plus_3") == 0
    assert json.loads((tmp_path / "out3" / "metadata.json").read_text())["dense_transform"] == "log_plus_3"
    want = read_tsv(files[0], RAW, on_bad_rows="skip", dense_transform="log_plus_3")
    np.testing.assert_array_equal(np.load(tmp_path / "out3" / "day_0_dense.npy"), want.dense)


def test_chunks_are_joined_blocks(tmp_path, monkeypatch) -> None:
    """Rows come out in order, several reader blocks per chunk."""
    path = synthetic_files(tmp_path, (3_000,))[0]
    want = read_tsv(path, RAW)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 64 * 1024)
    chunks = [arrays for arrays, _ in preprocess.iter_chunks(path, "log1p", "error", block_bytes=200 * 1024)]
    assert len(chunks) == -(-path.stat().st_size // (192 * 1024))  # three 64 KiB blocks per chunk
    got = CriteoArrays.concat(chunks)
    for name in ("dense", "sparse", "labels"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_id_counter_merges_exactly() -> None:
    rng = np.random.default_rng(3)
    counter = preprocess.IdCounter()
    counter.MIN_MERGE_KEYS = 50  # merge often
    chunks = [rng.integers(0, 40, (int(rng.integers(1, 30)), 26)) for _ in range(40)]
    for chunk in chunks:
        counter.add_ids(chunk)
    everything = np.concatenate(chunks)
    for j, (ids, counts) in enumerate(counter.per_feature()):
        want_ids, want_counts = np.unique(everything[:, j], return_counts=True)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(counts, want_counts)


def test_streaming_writer_patches_the_header(tmp_path) -> None:
    writer = preprocess.NpyStreamWriter(tmp_path / "x.npy", np.float32, (13,))
    parts = [np.full((n, 13), n, np.float32) for n in (3, 0, 5)]
    for part in parts:
        writer.write(part)
    writer.finish()
    assert writer.partial.name == f"x.npy.partial-{socket.gethostname()}-{os.getpid()}"  # this writer's own
    writer.commit()
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy", mmap_mode="r"), np.concatenate(parts))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy"]


def test_distinct_ids_are_exact() -> None:
    rng = np.random.default_rng(4)
    counter = preprocess.DistinctIds()
    chunks = [rng.integers(0, 2**32, (int(rng.integers(0, 300)), 26)) % rng.integers(1, 2**32, 26) for _ in range(30)]
    for chunk in chunks:
        counter.add_ids(chunk)
    every = np.concatenate(chunks)
    for j, ids in enumerate(counter.per_feature()):
        assert ids.dtype == np.uint32
        np.testing.assert_array_equal(ids, np.unique(every[:, j]))
