"""The raw Criteo TSV reader: real rows against a plain Python reference parser, the variants
seen in the wild (stripped trailing fields, CRLF, no final newline, unlabelled rows), and every
kind of malformed input, which must fail loudly with the file name and the right line."""

from __future__ import annotations

import functools
import gzip
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from app.data import tsv, tsv_stream
from app.data import tsv as tsv_output  # the reader was merged into three modules: tsv, tsv_stream, tsv_decode
from app.data import tsv as tsv_pipeline
from app.data import tsv_decode as tsv_format
from app.data.synthetic import write_synthetic_criteo
from app.data.tsv import (
    CriteoArrays,
    CriteoFormatError,
    expand_paths,
    iter_tsv_chunks,
    parse_tsv_bytes,
    read_tsv,
    read_tsv_files,
)

REAL_DIR = Path(__file__).resolve().parents[3] / "shared/data/criteo"
REAL_FILES = {"terabyte_day0_10k.tsv": 10_000, "kaggle_train_4571.tsv": 4_571}

RAW = [2**32] * 26  # modulo 2**32 keeps the 32-bit ids as they are
SMALL = [3, 7, 10, 97, 100, 1_000, 4_096, 10_000, 65_537, 10**6] * 2 + [2, 5, 11, 13, 40_000_000, 2**31]


def real_file(name: str) -> Path:
    path = REAL_DIR / name
    if not path.is_file():
        pytest.skip(f"real Criteo rows not available: {path} is absent (fixtures live outside the repo)")
    return path


def reference_parse(text: str, moduli: list[int], labelled: bool = True) -> dict[str, np.ndarray]:
    """Obviously correct, slow: split every line, pad on the right, convert field by field."""
    return _reference_parse(text, tuple(moduli), labelled)


@functools.lru_cache(maxsize=16)  # several tests check the same fixture against the same reference
def _reference_parse(text: str, moduli: tuple[int, ...], labelled: bool) -> dict[str, np.ndarray]:
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the final newline ends the last line, it does not start another
    width = 40 if labelled else 39
    labels, dense, sparse = [], [], []
    for line in lines:
        fields = line.rstrip("\r\n").split("\t")
        assert len(fields) <= width
        fields += [""] * (width - len(fields))
        if labelled:
            labels.append(float(fields.pop(0)))
        dense.append([max(int(v), 0) if v else 0 for v in fields[:13]])
        sparse.append([int(v, 16) % m if v else 0 for v, m in zip(fields[13:], moduli)])
    return {
        # the documented transform, applied to the reference integers
        "dense": np.log1p(np.array(dense, dtype=np.float64)).astype(np.float32),
        "sparse": np.array(sparse, dtype=np.int64),
        "labels": np.array(labels if labelled else [-1.0] * len(lines), dtype=np.float32),
    }


def assert_matches(arrays: CriteoArrays, expected: dict[str, np.ndarray]) -> None:
    assert arrays.dense.dtype == np.float32 and arrays.dense.shape == expected["dense"].shape
    assert arrays.sparse.dtype == np.int64 and arrays.sparse.shape == expected["sparse"].shape
    assert arrays.labels.dtype == np.float32 and arrays.labels.shape == expected["labels"].shape
    np.testing.assert_array_equal(arrays.dense, expected["dense"])
    np.testing.assert_array_equal(arrays.sparse, expected["sparse"])
    np.testing.assert_array_equal(arrays.labels, expected["labels"])


@pytest.fixture(params=[None, 16_384], ids=["default-chunks", "16KiB-chunks"])
def chunk_bytes(request, monkeypatch) -> None:
    """Run a test with the default chunking and with many small chunks (line numbering, joins)."""
    if request.param is not None:
        monkeypatch.setattr(tsv, "CHUNK_BYTES", request.param)


# ----------------------------------------------------------------------------------------------
# Real rows
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REAL_FILES))
@pytest.mark.parametrize("moduli", [RAW, SMALL], ids=["raw-ids", "small-tables"])
def test_real_rows_match_the_reference_parser(name, moduli, chunk_bytes):
    path = real_file(name)
    expected = reference_parse(path.read_text("ascii"), moduli)
    arrays = read_tsv(path, moduli)
    assert len(arrays) == REAL_FILES[name]  # every row read, none dropped
    assert_matches(arrays, expected)


def test_real_positive_counts():
    terabyte = read_tsv(real_file("terabyte_day0_10k.tsv"), RAW)
    assert int(terabyte.labels.sum()) == 265  # 2.65 % of 10,000
    kaggle_path = real_file("kaggle_train_4571.tsv")
    positives = sum(line.split("\t", 1)[0] == "1" for line in kaggle_path.read_text("ascii").splitlines())
    kaggle = read_tsv(kaggle_path, RAW)
    assert int(kaggle.labels.sum()) == positives
    assert positives / 4_571 == pytest.approx(0.225, abs=0.001)


def test_real_rows_cover_the_format():
    """The fixtures exercise what the reader must handle: negatives and missing values."""
    for name, negative_column in [("kaggle_train_4571.tsv", 2), ("terabyte_day0_10k.tsv", 8)]:
        rows = [line.split("\t") for line in real_file(name).read_text("ascii").splitlines()]
        assert any(row[negative_column].startswith("-") for row in rows)  # Kaggle I2, Terabyte I8
        assert any("" in row for row in rows)  # missing values


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_rows_stripped_crlf_and_no_final_newline(name, tmp_path, chunk_bytes):
    """Files in the wild: trailing empty fields stripped, CRLF endings, no newline at the end."""
    original = real_file(name).read_text("ascii")
    stripped = [line.rstrip("\t") for line in original.splitlines()]
    if name.startswith("kaggle"):  # Kaggle rows often end with missing C25/C26 (Terabyte's not)
        assert sum(len(line.split("\t")) < 40 for line in stripped) > 1_000
    path = tmp_path / name
    path.write_bytes("\r\n".join(stripped).encode())
    assert_matches(read_tsv(path, SMALL), reference_parse(original, SMALL))
    assert_matches(read_tsv(path, SMALL, labelled=True), reference_parse(original, SMALL))


@pytest.mark.parametrize("name", sorted(REAL_FILES))
@pytest.mark.parametrize("strip", [False, True], ids=["39-fields", "stripped"])
def test_real_rows_unlabelled(name, strip, tmp_path, chunk_bytes):
    """Kaggle test.txt style: no label column; auto-detected; labels are -1."""
    unlabelled = [line.split("\t", 1)[1] for line in real_file(name).read_text("ascii").splitlines()]
    if strip:
        unlabelled = [line.rstrip("\t") for line in unlabelled]
    path = tmp_path / name
    path.write_text("\n".join(unlabelled) + "\n")
    expected = reference_parse("\n".join(unlabelled), SMALL, labelled=False)
    assert_matches(read_tsv(path, SMALL), expected)
    assert_matches(read_tsv(path, SMALL, labelled=False), expected)


# ----------------------------------------------------------------------------------------------
# Variants and values, on small hand-made rows
# ----------------------------------------------------------------------------------------------

IDS = [f"{(j * 2_654_435_761 + 12_345) % 2**32:08x}" for j in range(26)]
GOOD = "\t".join(["1"] + [str(10 * k) for k in range(13)] + IDS)
UNLABELLED = GOOD.split("\t", 1)[1]


def with_field(row: str, index: int, value: str) -> str:
    fields = row.split("\t")
    fields[index] = value
    return "\t".join(fields)


def write(tmp_path: Path, lines: list[str], name: str = "rows.tsv", end: str = "\n") -> Path:
    path = tmp_path / name
    path.write_bytes((end.join(lines) + end).encode("latin-1"))
    return path


def test_short_rows_are_padded_on_the_right(tmp_path):
    # 38 fields: C25 and C26 stripped. C24 must stay C24 (torchrec's mapper would shift it).
    short = "\t".join(GOOD.split("\t")[:38])
    arrays = read_tsv(write(tmp_path, [GOOD, short]), RAW)
    np.testing.assert_array_equal(arrays.sparse[1, :24], arrays.sparse[0, :24])
    np.testing.assert_array_equal(arrays.sparse[1, 24:], [0, 0])
    # Label and I1..I13 are the least a row may keep: anything shorter is a cut-off line.
    least = read_tsv(write(tmp_path, [GOOD, "\t".join(GOOD.split("\t")[:14])], name="least.tsv"), RAW)
    np.testing.assert_array_equal(least.dense[1], least.dense[0])
    assert not least.sparse[1].any()
    with pytest.raises(CriteoFormatError, match=r"tiny\.tsv:2: too few fields: 2 \(a row needs at least 14"):
        read_tsv(write(tmp_path, [GOOD, "0\t5"], name="tiny.tsv"), RAW)  # label and I1 only


def test_dense_values(tmp_path):
    values = ["-1", "-3", "0", "007", "2147483648", "9999999999", "123456789012345678", "", "5"]
    values += ["1"] * (13 - len(values))
    row = "\t".join(["0"] + values + IDS)
    arrays = read_tsv(write(tmp_path, [row]), RAW)
    expected = [0, 0, 0, 7, 2_147_483_648, 9_999_999_999, 123_456_789_012_345_678, 0, 5] + [1] * 4
    np.testing.assert_array_equal(arrays.dense[0], np.log1p(np.array(expected, np.float64)).astype(np.float32))


def test_hex_ids_any_case_and_length(tmp_path):
    ids = ["0", "f", "F", "00000000", "ffffffff", "FFFFFFFF", "aBcDeF12", "1", "12345", ""] + IDS[10:]
    row = "\t".join(["0"] + ["1"] * 13 + ids)
    arrays = read_tsv(write(tmp_path, [row]), RAW)
    expected = [int(v, 16) if v else 0 for v in ids]
    np.testing.assert_array_equal(arrays.sparse[0], expected)
    small = read_tsv(write(tmp_path, [row], name="small.tsv"), SMALL)
    np.testing.assert_array_equal(small.sparse[0], [e % m for e, m in zip(expected, SMALL)])


def test_crlf_and_missing_final_newline(tmp_path):
    expected = read_tsv(write(tmp_path, [GOOD, GOOD, GOOD]), RAW)
    for name, data in {
        "crlf.tsv": f"{GOOD}\r\n{GOOD}\r\n{GOOD}\r\n",
        "no-final.tsv": f"{GOOD}\n{GOOD}\n{GOOD}",
        "crlf-no-final.tsv": f"{GOOD}\r\n{GOOD}\r\n{GOOD}",
        "mixed.tsv": f"{GOOD}\r\n{GOOD}\n{GOOD}\r\n",
    }.items():
        (tmp_path / name).write_bytes(data.encode())
        arrays = read_tsv(tmp_path / name, RAW)
        assert len(arrays) == 3
        assert_matches(arrays, {"dense": expected.dense, "sparse": expected.sparse, "labels": expected.labels})


def test_labelled_detection_uses_the_widest_row(tmp_path):
    # The first row lost its empty C26, so it has 39 fields; the file is still labelled.
    first = with_field(GOOD, 39, "").rstrip("\t")
    arrays = read_tsv(write(tmp_path, [first, GOOD]), RAW)
    np.testing.assert_array_equal(arrays.labels, [1, 1])
    unlabelled = read_tsv(write(tmp_path, [UNLABELLED, UNLABELLED], name="u.tsv"), RAW)
    np.testing.assert_array_equal(unlabelled.labels, [-1, -1])
    np.testing.assert_array_equal(unlabelled.sparse[:, :25], arrays.sparse[:, :25])
    assert arrays.sparse[0, 25] == 0 and arrays.sparse[1, 25] == unlabelled.sparse[0, 25]


def test_parse_tsv_bytes_numbers_lines_from_the_given_start():
    arrays = parse_tsv_bytes(f"{GOOD}\n{GOOD}\n".encode(), 1, "chunk.tsv", RAW, None)
    assert len(arrays) == 2
    bad = f"{GOOD}\n{with_field(GOOD, 0, '7')}\n".encode()
    with pytest.raises(CriteoFormatError, match=r"^day_0:1001: label = '7' is not 0 or 1"):
        parse_tsv_bytes(bad, 1000, "day_0", RAW, True)


def test_wrong_table_sizes_are_rejected(tmp_path):
    path = write(tmp_path, [GOOD])
    with pytest.raises(ValueError, match="26 positive table sizes"):
        read_tsv(path, [10] * 25)
    with pytest.raises(ValueError, match="26 positive table sizes"):
        read_tsv(path, [10] * 25 + [0])


# ----------------------------------------------------------------------------------------------
# Malformed input: a CriteoFormatError naming file:line and the problem
# ----------------------------------------------------------------------------------------------

BAD_ROWS = {  # case -> (bad row, expected message after "file:line: ")
    "too-many-fields": (GOOD + "\t1a2b", "too many fields: 41"),
    "dense-decimal-point": (with_field(GOOD, 3, "1.5"), "field I3 = '1.5' is not an integer"),
    "dense-letters": (with_field(GOOD, 1, "abc"), "field I1 = 'abc' is not an integer"),
    "dense-lone-minus": (with_field(GOOD, 13, "-"), "field I13 = '-' is not an integer"),
    "dense-double-minus": (with_field(GOOD, 2, "--1"), "field I2 = '--1' is not an integer"),
    "dense-inner-minus": (with_field(GOOD, 2, "1-2"), "field I2 = '1-2' is not an integer"),
    "dense-plus": (with_field(GOOD, 2, "+5"), "field I2 = '+5' is not an integer"),
    "dense-space": (with_field(GOOD, 4, " 5"), "field I4 = ' 5' is not an integer"),
    "dense-19-digits": (with_field(GOOD, 5, "1" * 19), f"field I5 = '{'1' * 19}' is not an integer"),
    "dense-hex": (with_field(GOOD, 6, "68fd1e64"), "field I6 = '68fd1e64' is not an integer"),
    "hex-letters": (with_field(GOOD, 16, "zz12"), "field C3 = 'zz12' is not a hex id"),
    "hex-9-digits": (with_field(GOOD, 14, "123456789"), "field C1 = '123456789' is not a hex id"),
    "hex-minus": (with_field(GOOD, 39, "-1ab"), "field C26 = '-1ab' is not a hex id"),
    "hex-g": (with_field(GOOD, 20, "6g"), "field C7 = '6g' is not a hex id"),
    "hex-space": (with_field(GOOD, 21, "abc def"), "field C8 = 'abc def' is not a hex id"),
    "label-2": (with_field(GOOD, 0, "2"), "label = '2' is not 0 or 1"),
    "label-empty": (with_field(GOOD, 0, ""), "label = '' is not 0 or 1"),
    "label-01": (with_field(GOOD, 0, "01"), "label = '01' is not 0 or 1"),
    "label-minus-1": (with_field(GOOD, 0, "-1"), "label = '-1' is not 0 or 1"),
    "empty-line": ("", "empty line"),
    "empty-crlf-line": ("\r", "empty line"),
    "nul-byte": (with_field(GOOD, 3, "1\x002"), "control byte 0x00 at column"),
    "vertical-tab": (with_field(GOOD, 16, "ab\x0bcd"), "control byte 0x0b at column"),
    "delete-byte": (with_field(GOOD, 16, "ab\x7f"), "control byte 0x7f at column"),
    "non-ascii": (with_field(GOOD, 16, "caf\xe9"), "non-ASCII byte 0xe9 at column"),
    "lone-carriage-return": (with_field(GOOD, 16, "ab\rcd"), "carriage return (\\r) that does not end the line"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
@pytest.mark.parametrize("bad_line", [1, 4, 7])
def test_malformed_row_names_file_and_line(case, bad_line, tmp_path):
    row, message = BAD_ROWS[case]
    lines = [GOOD] * 7
    lines[bad_line - 1] = row
    path = write(tmp_path, lines, name="kaggle.tsv")
    with pytest.raises(CriteoFormatError) as raised:
        read_tsv(path, SMALL, labelled=True)
    assert str(raised.value).startswith(f"{path}:{bad_line}: "), str(raised.value)
    assert message in str(raised.value)


def test_column_of_a_bad_byte(tmp_path):
    path = write(tmp_path, [GOOD, "1\t2\x003" + GOOD[5:]])
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:2: control byte 0x00 at column 4 "):
        read_tsv(path, RAW)


def test_unlabelled_file_with_a_labelled_row(tmp_path):
    path = write(tmp_path, [UNLABELLED, UNLABELLED, GOOD])
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:3: too many fields: 40 \(an unlabelled row"):
        read_tsv(path, RAW, labelled=False)


def test_labelled_file_read_as_unlabelled_fails_on_line_1(tmp_path):
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:1: too many fields: 40"):
        read_tsv(write(tmp_path, [GOOD, GOOD]), RAW, labelled=False)


def test_the_first_bad_line_is_reported(tmp_path, chunk_bytes):
    """A value error on an earlier line wins over a structural error on a later one."""
    lines = [GOOD] * 60
    lines[41] = with_field(GOOD, 20, "xyz")  # line 42: a bad id
    lines[44] = GOOD + "\t1"  # line 45: too many fields
    lines[49] = ""  # line 50: empty
    path = write(tmp_path, lines)
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:42: field C7 = 'xyz' is not a hex id"):
        read_tsv(path, RAW)
    lines[41] = GOOD
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:45: too many fields"):
        read_tsv(write(tmp_path, lines), RAW)
    lines[44] = GOOD
    lines[46] = with_field(GOOD, 0, "x")
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:47: label = 'x'"):
        read_tsv(write(tmp_path, lines), RAW)


def test_line_numbers_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 1_000)  # about 4 rows per chunk
    lines = [GOOD] * 500
    lines[456] = with_field(GOOD, 25, "nothex")
    with pytest.raises(CriteoFormatError, match=r"rows\.tsv:457: field C12 = 'nothex'"):
        read_tsv(write(tmp_path, lines), RAW)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.tsv"
    path.write_bytes(b"")
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv:1: file is empty"):
        read_tsv(path, RAW)


def test_only_newline(tmp_path):
    path = tmp_path / "blank.tsv"
    path.write_bytes(b"\n")
    with pytest.raises(CriteoFormatError, match=r"blank\.tsv:1: empty line"):
        read_tsv(path, RAW)


def test_undecidable_labelling(tmp_path):
    with pytest.raises(CriteoFormatError, match=r"short\.tsv:1: cannot tell whether the rows are labelled"):
        read_tsv(write(tmp_path, ["1\t2\t3"], name="short.tsv"), RAW)
    with pytest.raises(CriteoFormatError, match=r"short\.tsv:1: too few fields: 3"):  # too short either way
        read_tsv(write(tmp_path, ["1\t2\t3"], name="short.tsv"), RAW, labelled=True)


def test_long_garbage_is_shortened_in_the_message(tmp_path):
    path = write(tmp_path, [with_field(GOOD, 30, "x" * 500)])
    with pytest.raises(CriteoFormatError) as raised:
        read_tsv(path, RAW)
    assert len(str(raised.value)) < 200 and "..." in str(raised.value)


# ----------------------------------------------------------------------------------------------
# Several files and path specs
# ----------------------------------------------------------------------------------------------


def test_read_tsv_files_concatenates_in_order(tmp_path):
    first = write(tmp_path, [GOOD, with_field(GOOD, 0, "0")], name="b.tsv")
    second = write(tmp_path, [with_field(GOOD, 1, "99")], name="a.tsv")
    arrays = read_tsv_files([first, second], RAW)
    np.testing.assert_array_equal(arrays.labels, [1, 0, 1])
    assert arrays.dense[2, 0] == np.float32(np.log1p(99.0))
    both = CriteoArrays.concat([read_tsv(first, RAW), read_tsv(second, RAW)])
    assert_matches(arrays, {"dense": both.dense, "sparse": both.sparse, "labels": both.labels})


def test_read_tsv_files_refuses_to_mix_labelled_and_unlabelled(tmp_path):
    labelled = write(tmp_path, [GOOD], name="train.tsv")
    unlabelled = write(tmp_path, [UNLABELLED], name="test.tsv")
    with pytest.raises(CriteoFormatError, match=r"test\.tsv:1: file is unlabelled but .*train\.tsv is labelled"):
        read_tsv_files([labelled, unlabelled], RAW)


def test_concat_of_nothing():
    empty = CriteoArrays.concat([])
    assert len(empty) == 0 and empty.dense.shape == (0, 13) and empty.sparse.shape == (0, 26)


def test_expand_paths(tmp_path):
    folder = tmp_path / "days"
    folder.mkdir()
    for name in ["day_1.tsv", "day_0.tsv", "day_2.txt", "notes.md", "day_3.tsv.gz"]:
        (folder / name).write_text("x")
    (folder / "sub.tsv").mkdir()  # a directory named like a data file is not a file
    day0, day1, day2 = folder / "day_0.tsv", folder / "day_1.tsv", folder / "day_2.txt"
    day3 = folder / "day_3.tsv.gz"  # gzip files are data files too
    assert expand_paths(folder) == [day0, day1, day2, day3]
    assert expand_paths(str(folder)) == [day0, day1, day2, day3]
    assert expand_paths(day1) == [day1]
    assert expand_paths(str(folder / "day_*.tsv")) == [day0, day1]
    assert expand_paths([day2, str(folder / "day_[01].tsv")]) == [day2, day0, day1]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing.tsv", "does not exist"),
        ("nothing-*.tsv", "no data files match"),
        ("empty-dir", "contains no *.tsv or *.txt files"),
    ],
)
def test_expand_paths_names_what_is_missing(spec, message, tmp_path):
    (tmp_path / "empty-dir").mkdir()
    full = str(tmp_path / spec)
    with pytest.raises(FileNotFoundError) as raised:
        expand_paths(full)
    assert full in str(raised.value) and message in str(raised.value)


def test_expand_paths_empty_list():
    with pytest.raises(FileNotFoundError, match="empty"):
        expand_paths([])


# ----------------------------------------------------------------------------------------------
# gzip, streaming blocks, skipping bad rows, the dense transform
# ----------------------------------------------------------------------------------------------


def as_expected(arrays: CriteoArrays) -> dict[str, np.ndarray]:
    return {"dense": arrays.dense, "sparse": arrays.sparse, "labels": arrays.labels}


def write_gz(path: Path, data: bytes) -> Path:
    path.write_bytes(gzip.compress(data))
    return path


def numbered_rows(count: int) -> list[str]:
    """Good rows that differ from each other (I1 = index), so a dropped or shifted row shows."""
    return [with_field(GOOD, 1, str(index)) for index in range(count)]


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_gzip_reads_like_plain_on_real_rows(name, tmp_path, chunk_bytes):
    path = real_file(name)
    original = path.read_bytes()
    plain = read_tsv(path, SMALL)
    gz = write_gz(tmp_path / f"{name}.gz", original)
    assert_matches(read_tsv(gz, SMALL), as_expected(plain))
    # The gzip magic bytes are recognised whatever the name.
    unnamed = write_gz(tmp_path / "day_0", original)
    assert_matches(read_tsv(unnamed, SMALL), as_expected(plain))
    both = read_tsv_files([gz, path], SMALL)
    assert_matches(both, as_expected(CriteoArrays.concat([plain, plain])))


def test_gzip_with_crlf_stripped_fields_and_no_final_newline(tmp_path):
    short = "\t".join(GOOD.split("\t")[:38])
    lines = numbered_rows(20) + [short]
    expected = read_tsv(write(tmp_path, lines), RAW)
    gz = write_gz(tmp_path / "crlf.tsv.gz", "\r\n".join(lines).encode())
    assert_matches(read_tsv(gz, RAW), as_expected(expected))
    chunks = [chunk for chunk, _ in iter_tsv_chunks(gz, RAW, block_bytes=300)]
    assert len(chunks) > 5  # the \r\n pairs cross block boundaries somewhere
    assert_matches(CriteoArrays.concat(chunks), as_expected(expected))


def test_truncated_gzip_names_the_file_and_the_last_complete_line(tmp_path):
    lines = numbered_rows(400)
    whole = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "day_0.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CriteoFormatError, match=r"day_0\.gz:\d+: gzip stream is truncated or corrupt"):
        read_tsv(path, RAW)
    # Streaming: the rows before the cut come out, then the error names the last complete line.
    rows_read = 0
    with pytest.raises(CriteoFormatError) as raised:
        for chunk, _ in iter_tsv_chunks(path, RAW, block_bytes=1_000):
            rows_read += len(chunk)
    assert 0 < rows_read < 400
    assert str(raised.value).startswith(f"{path}:{rows_read}: gzip stream is truncated or corrupt")


def test_corrupt_gzip_and_a_gz_name_that_is_not_gzip(tmp_path):
    data = bytearray(gzip.compress(("\n".join(numbered_rows(400)) + "\n").encode()))
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # zeroed deflate data
    (tmp_path / "corrupt.gz").write_bytes(bytes(data))
    with pytest.raises(CriteoFormatError, match=r"corrupt\.gz:\d+: gzip stream is truncated or corrupt"):
        read_tsv(tmp_path / "corrupt.gz", RAW)
    plain = write(tmp_path, [GOOD], name="plain.tsv.gz")
    with pytest.raises(CriteoFormatError, match=r"plain\.tsv\.gz:1: gzip stream is truncated or corrupt"):
        read_tsv(plain, RAW)


@pytest.mark.parametrize("compressed", [b"", gzip.compress(b"")], ids=["zero-bytes", "empty-stream"])
def test_empty_gzip_file(compressed, tmp_path):
    path = tmp_path / "day_5.gz"
    path.write_bytes(compressed)
    with pytest.raises(CriteoFormatError, match=r"day_5\.gz:1: file is empty"):
        read_tsv(path, RAW)


def test_overlong_line_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "binary.tsv"
    path.write_bytes(GOOD.encode() + b"\n" + b"x" * (tsv.MAX_LINE_BYTES + 10))
    with pytest.raises(CriteoFormatError, match=r"binary\.tsv:2: line is longer than"):
        read_tsv(path, RAW, on_bad_rows="skip")


@pytest.mark.parametrize("block_bytes", [1_000, 100], ids=["1000B-blocks", "blocks-shorter-than-a-line"])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gz"])
def test_tiny_blocks_give_identical_rows_and_line_numbers(block_bytes, compress, tmp_path, monkeypatch):
    lines = numbered_rows(300)
    data = ("\n".join(lines) + "\n").encode()
    expected = read_tsv(write(tmp_path, lines, name="big-blocks.tsv"), RAW)
    path = write_gz(tmp_path / "rows.gz", data) if compress else write(tmp_path, lines)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", block_bytes)
    assert_matches(read_tsv(path, RAW), as_expected(expected))
    chunks = [chunk for chunk, _ in iter_tsv_chunks(path, RAW, block_bytes=block_bytes)]
    assert len(chunks) > 50
    assert_matches(CriteoArrays.concat(chunks), as_expected(expected))
    for bad_line in [1, 2, 137, 299, 300]:
        broken = list(lines)
        broken[bad_line - 1] = with_field(GOOD, 25, "nothex")
        text = ("\n".join(broken) + "\n").encode()
        bad = write_gz(tmp_path / "bad.gz", text) if compress else write(tmp_path, broken, name="bad")
        pattern = rf"bad(\.gz)?:{bad_line}: field C12 = 'nothex'"
        with pytest.raises(CriteoFormatError, match=pattern):
            read_tsv(bad, RAW)
        with pytest.raises(CriteoFormatError, match=pattern):
            list(iter_tsv_chunks(bad, RAW, block_bytes=block_bytes))


def test_output_grows_when_the_row_estimate_falls_short(tmp_path, monkeypatch):
    lines = numbered_rows(300)
    expected = read_tsv(write(tmp_path, lines), RAW)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 1_000)
    monkeypatch.setattr(tsv_output._Output, "SLACK", 0.05)  # estimates far too low: several regrowths
    assert_matches(read_tsv(tmp_path / "rows.tsv", RAW), as_expected(expected))


# Every kind of malformed row at once, including a non-ASCII byte that the digit check alone
# would let through (0xb5 = '5' | 0x80).
SKIPPED = sorted(BAD_ROWS) + ["non-ascii-digit"]
BAD_ROWS_FOR_SKIP = {case: row for case, (row, _) in BAD_ROWS.items()}
BAD_ROWS_FOR_SKIP["non-ascii-digit"] = with_field(GOOD, 3, "1\xb52")


def file_with_bad_rows(tmp_path: Path, every: int = 3) -> tuple[Path, list[int], list[str]]:
    """Good numbered rows with every kind of bad row inserted; (path, bad line numbers, good rows)."""
    good = numbered_rows(len(SKIPPED) * every)
    lines, bad_lines = [], []
    for index, row in enumerate(good):
        if index % every == 1:
            lines.append(BAD_ROWS_FOR_SKIP[SKIPPED[index // every]])
            bad_lines.append(len(lines))
        lines.append(row)
    return write(tmp_path, lines, name="mixed.tsv"), bad_lines, good


@pytest.mark.parametrize("labelled", [True, None], ids=["labelled", "auto-detected"])
def test_skip_drops_exactly_the_bad_rows(labelled, tmp_path, chunk_bytes):
    path, bad_lines, good = file_with_bad_rows(tmp_path)
    expected = read_tsv(write(tmp_path, good, name="good.tsv"), SMALL)
    arrays = read_tsv(path, SMALL, labelled, on_bad_rows="skip")
    assert_matches(arrays, as_expected(expected))
    assert arrays.num_bad_rows == len(SKIPPED) == len(bad_lines)
    first_case = SKIPPED[0]
    assert arrays.first_bad_row.startswith(f"{path}:{bad_lines[0]}: ")
    assert BAD_ROWS[first_case][1] in arrays.first_bad_row
    with pytest.raises(CriteoFormatError, match=rf"mixed\.tsv:{bad_lines[0]}: "):
        read_tsv(path, SMALL, labelled)  # "error" is the default
    clean = read_tsv(write(tmp_path, good, name="good.tsv"), SMALL, on_bad_rows="skip")
    assert clean.num_bad_rows == 0 and clean.first_bad_row is None


def test_skip_in_gzip_across_tiny_blocks_and_in_iter_chunks(tmp_path, monkeypatch):
    path, bad_lines, good = file_with_bad_rows(tmp_path)
    expected = read_tsv(write(tmp_path, good, name="good.tsv"), RAW)
    gz = write_gz(tmp_path / "mixed.tsv.gz", path.read_bytes())
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 1_000)
    arrays = read_tsv(gz, RAW, on_bad_rows="skip")
    assert_matches(arrays, as_expected(expected))
    assert arrays.num_bad_rows == len(bad_lines)
    assert arrays.first_bad_row.startswith(f"{gz}:{bad_lines[0]}: ")
    chunks = list(iter_tsv_chunks(gz, RAW, block_bytes=700, on_bad_rows="skip"))
    assert sum(count for _, count in chunks) == len(bad_lines)
    assert all(count == chunk.num_bad_rows for chunk, count in chunks)
    assert_matches(CriteoArrays.concat([chunk for chunk, _ in chunks]), as_expected(expected))


def test_skip_on_real_rows_and_across_files(tmp_path):
    path = real_file("kaggle_train_4571.tsv")
    lines = path.read_text("ascii").splitlines()
    inserted = {0: "empty-line", 999: "non-ascii", 1000: "dense-plus", 3333: "hex-g", 4571: "label-2"}
    damaged = []  # the real lines, with a bad one before real line (index) in `inserted`
    for index in range(len(lines) + 1):
        if index in inserted:
            damaged.append(BAD_ROWS[inserted[index]][0])
        damaged.extend(lines[index : index + 1])
    bad = write(tmp_path, damaged, name="damaged.tsv")
    arrays = read_tsv(bad, SMALL, on_bad_rows="skip")
    assert len(arrays) == 4_571 and arrays.num_bad_rows == 5
    assert_matches(arrays, reference_parse(path.read_text("ascii"), SMALL))
    assert arrays.first_bad_row.startswith(f"{bad}:1: empty line")
    both = read_tsv_files([path, bad], SMALL, on_bad_rows="skip")
    assert len(both) == 2 * 4_571 and both.num_bad_rows == 5 and both.first_bad_row == arrays.first_bad_row


def test_skip_an_unlabelled_file_and_a_first_block_of_only_bad_rows(tmp_path, monkeypatch):
    # An empty line in an unlabelled file would parse as a row of missing values: it is dropped.
    arrays = read_tsv(write(tmp_path, [UNLABELLED, "", UNLABELLED], name="u.tsv"), RAW, on_bad_rows="skip")
    assert len(arrays) == 2 and arrays.num_bad_rows == 1 and (arrays.labels == -1).all()
    # Nothing in the first block can vote on labelled/unlabelled: the next block decides.
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 100)
    lines = ["", "\x00" * 150, "\x00"] + [UNLABELLED] * 3
    arrays = read_tsv(write(tmp_path, lines, name="u2.tsv"), RAW, on_bad_rows="skip")
    assert len(arrays) == 3 and arrays.num_bad_rows == 3 and (arrays.labels == -1).all()
    nothing = read_tsv(write(tmp_path, ["", "\x01"], name="none.tsv"), RAW, on_bad_rows="skip")
    assert len(nothing) == 0 and nothing.num_bad_rows == 2


def test_concat_adds_bad_row_counts():
    parts = [tsv_format._empty_arrays(0) for _ in range(3)]
    parts[1].num_bad_rows, parts[1].first_bad_row = 2, "a:3: x"
    parts[2].num_bad_rows, parts[2].first_bad_row = 1, "b:1: y"
    joined = CriteoArrays.concat(parts)
    assert joined.num_bad_rows == 3 and joined.first_bad_row == "a:3: x"


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_iter_tsv_chunks_concatenated_equals_read_tsv(name):
    path = real_file(name)
    chunks = list(iter_tsv_chunks(path, SMALL, block_bytes=64 * 1024))
    assert len(chunks) > 10 and all(count == 0 for _, count in chunks)
    assert_matches(CriteoArrays.concat([chunk for chunk, _ in chunks]), as_expected(read_tsv(path, SMALL)))


def test_log_plus_3_values(tmp_path):
    values = ["-3", "-2", "-1", "0", "", "1", "5", "1000000", "123456789012345678", "7", "0", "2", "3"]
    row = "\t".join(["1"] + values + IDS)
    arrays = read_tsv(write(tmp_path, [row]), RAW, dense_transform="log_plus_3")
    raw = np.array([-2, -2, -1, 0, 0, 1, 5, 1_000_000, 123_456_789_012_345_678, 7, 0, 2, 3], np.float64)
    np.testing.assert_array_equal(arrays.dense[0], np.log(raw + 3).astype(np.float32))
    assert arrays.dense[0, 0] == 0.0 and arrays.dense[0, 4] == np.float32(np.log(3.0))  # -3 clamped; missing
    default = read_tsv(write(tmp_path, [row]), RAW)
    np.testing.assert_array_equal(default.dense[0], np.log1p(np.maximum(raw, 0)).astype(np.float32))
    np.testing.assert_array_equal(arrays.sparse, default.sparse)


def test_log_plus_3_on_real_rows():
    path = real_file("kaggle_train_4571.tsv")
    raw = [[int(v) if v else 0 for v in line.split("\t")[1:14]] for line in path.read_text("ascii").splitlines()]
    expected = np.log(np.maximum(np.array(raw, np.float64), -2) + 3).astype(np.float32)
    arrays = read_tsv(path, RAW, dense_transform="log_plus_3")
    np.testing.assert_array_equal(arrays.dense, expected)
    assert (np.array(raw) < 0).any()  # the negative values are really exercised


@pytest.mark.parametrize("option", [{"on_bad_rows": "ignore"}, {"dense_transform": "log"}])
def test_unknown_options_are_rejected(option, tmp_path):
    path = write(tmp_path, [GOOD])
    with pytest.raises(ValueError, match=next(iter(option))):
        read_tsv(path, RAW, **option)
    with pytest.raises(ValueError, match=next(iter(option))):
        next(iter_tsv_chunks(path, RAW, **option))


def test_directories_and_patterns_in_natural_order(tmp_path):
    folder = tmp_path / "terabyte"
    folder.mkdir()
    names = ["day_10.gz", "day_2.gz", "day_1.gz", "day_0.gz", "day_23.gz", "day_3.txt.gz", "day_11.tsv"]
    for name in names + ["README.md", "day_4.npy"]:
        (folder / name).write_bytes(b"x")
    order = ["day_0.gz", "day_1.gz", "day_2.gz", "day_3.txt.gz", "day_10.gz", "day_11.tsv", "day_23.gz"]
    assert [p.name for p in expand_paths(folder)] == order
    assert [p.name for p in expand_paths(str(folder / "day_*.gz"))] == [n for n in order if n.endswith(".gz")]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape("contains no *.tsv or *.txt files")):
        expand_paths(tmp_path / "empty")


# ----------------------------------------------------------------------------------------------
# Blocks parsed on several threads: the same rows, counts and first error as one thread
# ----------------------------------------------------------------------------------------------


def assert_same_bits(got: CriteoArrays, want: CriteoArrays) -> None:
    """The same arrays bit for bit (float32 compared as bytes), and the same bad-row accounts."""
    for a, b in [(got.dense, want.dense), (got.sparse, want.sparse), (got.labels, want.labels)]:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    assert (got.num_bad_rows, got.first_bad_row) == (want.num_bad_rows, want.first_bad_row)


def raised_by(read) -> str:
    with pytest.raises(CriteoFormatError) as raised:
        read()
    return str(raised.value)


# A bound on the held-back parse's wait, never reached when the reader works: past it the parse goes
# on and the test's overtaken() check fails instead of hanging.
HOLD_LIMIT_S = 60


class SlowBlock:
    """Holds back the parse of the block holding ``marker`` until the reader waits for its result and
    blocks after it are done (their futures settled, result or error): the blocks holding
    ``after_lines``, or else any later block; or until ``release(finished)`` says so. Later blocks thus
    finish first, and the reader has seen them finish, whatever the machine's load. ``finished`` lists
    (first line, holds the marker) of each block in the order their futures settled; the test may
    ``note`` events of its own there."""

    def __init__(self, monkeypatch, marker: bytes, after_lines: tuple[int, ...] = (), release=None) -> None:
        self.finished: list[tuple[int, bool]] = []
        self._blocks: dict[int, int] = {}  # first line -> lines, of every block started
        self._reader_waits = False
        self._changed = threading.Condition()
        parse, start_parse = tsv_pipeline._parse, tsv_pipeline._start_parse

        def ready(first_line: int) -> bool:
            if release is not None:
                return release(self.finished)
            done = {line for line, _ in self.finished}
            if after_lines:
                later_done = all(any(f <= line < f + n and f in done for f, n in self._blocks.items()) for line in after_lines)
            else:
                later_done = any(line > first_line for line in done)
            return later_done and self._reader_waits

        def held_back(buf, first_line_number, *args):
            if marker in bytes(buf):
                with self._changed:
                    self._changed.wait_for(lambda: ready(first_line_number), timeout=HOLD_LIMIT_S)
            return parse(buf, first_line_number, *args)

        def started(pool, args, *rest):
            buf, first_line = bytes(args[0]), args[1]
            with self._changed:
                self._blocks[first_line] = buf.count(b"\n") + (not buf.endswith(b"\n"))
            future = start_parse(pool, args, *rest)
            future.add_done_callback(lambda _: self.note((first_line, marker in buf)))
            return _Watched(future, self._reader_waits_now) if marker in buf else future

        monkeypatch.setattr(tsv_pipeline, "_parse", held_back)
        monkeypatch.setattr(tsv_pipeline, "_start_parse", started)

    def _reader_waits_now(self) -> None:
        with self._changed:
            self._reader_waits = True
            self._changed.notify_all()

    def note(self, event: tuple[int, bool]) -> None:
        with self._changed:
            self.finished.append(event)
            self._changed.notify_all()


class _Watched:
    """A future that calls ``on_wait`` when its result is asked for."""

    def __init__(self, future, on_wait) -> None:
        self._future = future
        self._on_wait = on_wait

    def result(self, timeout=None):
        self._on_wait()
        return self._future.result(timeout)

    def __getattr__(self, name: str):
        return getattr(self._future, name)


def slow_block(monkeypatch, marker: bytes, after_lines: tuple[int, ...] = ()) -> list[tuple[int, bool]]:
    """The block holding ``marker`` finishes after later blocks (``SlowBlock``); returns (first line,
    holds the marker) of each block, in the order they finished."""
    return SlowBlock(monkeypatch, marker, after_lines).finished


def overtaken(finished: list[tuple[int, bool]]) -> bool:
    """Whether a block after the slow one finished before it."""
    slow_at = next(i for i, (_, slow) in enumerate(finished) if slow)
    slow_line = finished[slow_at][0]
    return any(line > slow_line for line, _ in finished[:slow_at])


@pytest.fixture(scope="module")
def synthetic_files(tmp_path_factory) -> dict[str, Path]:
    """Synthetic sample files (as data/make_sample.py writes, smaller), plain and gzip."""
    folder = tmp_path_factory.mktemp("threads")
    files = {"train.tsv": True, "predict.tsv": False}  # name -> labelled
    for seed, (name, labelled) in enumerate(files.items(), start=1):
        write_synthetic_criteo(folder / name, 2_000, seed=seed, labelled=labelled)
        write_gz(folder / f"{name}.gz", (folder / name).read_bytes())
    return {path.name: path for path in folder.iterdir()}


@pytest.mark.parametrize(
    "name, num_threads", [("train.tsv", 8), ("predict.tsv", 3), ("train.tsv.gz", 2)]
)
def test_threads_read_the_synthetic_sample_like_one_thread(name, num_threads, synthetic_files, monkeypatch):
    path = synthetic_files[name]
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 8 * 1024)  # about 60 blocks
    want = read_tsv(path, SMALL, num_threads=1)
    assert len(want) == 2_000
    assert_same_bits(read_tsv(path, SMALL, num_threads=num_threads), want)
    log3 = read_tsv(path, SMALL, dense_transform="log_plus_3", num_threads=num_threads)
    assert_same_bits(log3, read_tsv(path, SMALL, dense_transform="log_plus_3", num_threads=1))
    chunks = list(iter_tsv_chunks(path, SMALL, block_bytes=8 * 1024, num_threads=num_threads))
    assert len(chunks) > 40
    assert_same_bits(CriteoArrays.concat([chunk for chunk, _ in chunks]), want)


def test_threads_read_several_files_like_one_thread(synthetic_files, monkeypatch):
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 16 * 1024)
    paths = [synthetic_files["train.tsv.gz"], synthetic_files["train.tsv"]]
    assert_same_bits(read_tsv_files(paths, RAW, num_threads=4), read_tsv_files(paths, RAW, num_threads=1))
    mixed = [synthetic_files["train.tsv"], synthetic_files["predict.tsv.gz"]]
    message = raised_by(lambda: read_tsv_files(mixed, RAW, num_threads=1))
    assert "labelled and unlabelled files cannot be mixed" in message
    assert raised_by(lambda: read_tsv_files(mixed, RAW, num_threads=4)) == message


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_threads_read_real_rows_like_one_thread(name, monkeypatch):
    path = real_file(name)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 16 * 1024)  # about 100 blocks
    want = read_tsv(path, SMALL, num_threads=1)
    assert len(want) == REAL_FILES[name]  # and equal to the reference parser: see the tests above
    assert_same_bits(read_tsv(path, SMALL, num_threads=4), want)
    chunks = [chunk for chunk, _ in iter_tsv_chunks(path, SMALL, block_bytes=16 * 1024, num_threads=4)]
    assert_same_bits(CriteoArrays.concat(chunks), want)


def test_threads_report_the_first_bad_line_when_a_later_block_fails_first(tmp_path, monkeypatch):
    lines = numbered_rows(400)
    lines[99] = with_field(GOOD, 20, "zzfirst")  # line 100: the first bad line
    lines[119] = GOOD + "\t1"  # line 120: too many fields, a few blocks later
    lines[139] = with_field(GOOD, 0, "7")  # line 140: a bad label
    path = write(tmp_path, lines)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 2_000)  # about 7 lines per block
    want = raised_by(lambda: read_tsv(path, RAW, num_threads=1))
    assert want.startswith(f"{path}:100: field C7 = 'zzfirst' is not a hex id")
    finished = slow_block(monkeypatch, b"zzfirst", after_lines=(120, 140))
    assert raised_by(lambda: read_tsv(path, RAW, num_threads=4)) == want
    assert overtaken(finished)  # the blocks of lines 120 and 140 failed while line 100's was slow
    finished.clear()
    assert raised_by(lambda: list(iter_tsv_chunks(path, RAW, block_bytes=2_000, num_threads=4))) == want
    assert overtaken(finished)
    # Skipping: the same rows, count and first example, in file order.
    monkeypatch.undo()
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 2_000)
    want_rows = read_tsv(path, RAW, on_bad_rows="skip", num_threads=1)
    assert want_rows.num_bad_rows == 3 and want_rows.first_bad_row == want
    finished = slow_block(monkeypatch, b"zzfirst")
    assert_same_bits(read_tsv(path, RAW, on_bad_rows="skip", num_threads=4), want_rows)
    assert overtaken(finished)


@pytest.mark.parametrize("labelled", [True, None], ids=["labelled", "auto-detected"])
def test_threads_skip_the_same_rows_while_the_output_grows(labelled, tmp_path, monkeypatch):
    """Bad rows in many blocks, dropped while the arrays are regrown several times."""
    path, bad_lines, _ = file_with_bad_rows(tmp_path)
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 1_000)
    monkeypatch.setattr(tsv_output._Output, "SLACK", 0.05)  # estimates far too low: several regrowths
    want = read_tsv(path, RAW, labelled, on_bad_rows="skip", num_threads=1)
    assert want.num_bad_rows == len(bad_lines)
    for num_threads in [2, 5]:
        assert_same_bits(read_tsv(path, RAW, labelled, on_bad_rows="skip", num_threads=num_threads), want)
        chunks = list(
            iter_tsv_chunks(path, RAW, labelled, block_bytes=1_000, on_bad_rows="skip", num_threads=num_threads)
        )
        assert sum(count for _, count in chunks) == len(bad_lines)
        assert_same_bits(CriteoArrays.concat([chunk for chunk, _ in chunks]), want)
    # The first blocks hold only bad rows: labelled/unlabelled is settled further on.
    lines = ["", "\x00" * 150, "\x00"] + [UNLABELLED] * 30
    unlabelled = write(tmp_path, lines, name="u.tsv")
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 100)
    want = read_tsv(unlabelled, RAW, on_bad_rows="skip", num_threads=1)
    assert len(want) == 30 and want.num_bad_rows == 3
    assert_same_bits(read_tsv(unlabelled, RAW, on_bad_rows="skip", num_threads=3), want)


def test_threads_and_damaged_gzip(tmp_path, monkeypatch):
    """The error of a damaged stream is the same, and an earlier bad line still comes first."""
    monkeypatch.setattr(tsv, "CHUNK_BYTES", 2_000)
    lines = numbered_rows(400)
    whole = gzip.compress(("\n".join(lines) + "\n").encode())
    cut = tmp_path / "cut.gz"
    cut.write_bytes(whole[: len(whole) // 2])  # truncated mid-stream
    no_trailer = tmp_path / "no-trailer.gz"
    no_trailer.write_bytes(whole[:-8])  # every line there, then the stream ends without its CRC
    for path in [cut, no_trailer]:
        want = raised_by(lambda: read_tsv(path, RAW, num_threads=1))
        assert "gzip stream is truncated or corrupt" in want
        assert raised_by(lambda: read_tsv(path, RAW, num_threads=4)) == want
        assert raised_by(lambda: read_tsv(path, RAW, on_bad_rows="skip", num_threads=4)) == want
        assert raised_by(lambda: list(iter_tsv_chunks(path, RAW, num_threads=4))) == want
    # A bad line in a block still being parsed when the damage is met: the bad line is reported.
    lines[384] = with_field(GOOD, 20, "zzlast")
    bad = tmp_path / "bad.gz"
    bad.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode())[:-8])
    want = raised_by(lambda: read_tsv(bad, RAW, num_threads=1))
    assert want.startswith(f"{bad}:385: field C7 = 'zzlast'")
    # The parse of line 385's block waits until the reader has met the damage.
    slow = SlowBlock(monkeypatch, b"zzlast", release=lambda done: (0, False) in done)
    events = slow.finished
    read_block = tsv_stream._read_block

    def noted_read_block(*args):
        try:
            return read_block(*args)
        except CriteoFormatError:
            slow.note((0, False))  # the damage was met
            raise

    monkeypatch.setattr(tsv_stream, "_read_block", noted_read_block)
    for read in [
        lambda: read_tsv(bad, RAW, num_threads=4),
        lambda: list(iter_tsv_chunks(bad, RAW, block_bytes=2_000, num_threads=4)),
    ]:
        events.clear()
        assert raised_by(read) == want
        assert (0, False) in events[: events.index(next(e for e in events if e[1]))]  # met while parsing


def test_threaded_iter_tsv_chunks_can_be_abandoned(synthetic_files):
    chunks = iter_tsv_chunks(synthetic_files["train.tsv"], RAW, block_bytes=4_096, num_threads=4)
    first, _ = next(chunks)
    assert len(first) > 0
    chunks.close()  # stops the parses in flight and closes the file


@pytest.mark.parametrize("num_threads", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_rejected(num_threads, tmp_path):
    path = write(tmp_path, [GOOD])
    with pytest.raises(ValueError, match="num_threads"):
        read_tsv(path, RAW, num_threads=num_threads)
    with pytest.raises(ValueError, match="num_threads"):
        next(iter_tsv_chunks(path, RAW, num_threads=num_threads))


def test_default_thread_count():
    assert 1 <= tsv.default_num_threads() <= tsv.MAX_DEFAULT_THREADS
