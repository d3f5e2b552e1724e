"""``python -m app export --format pt2``: a package that scores raw log rows as ``python -m app predict`` does, in a
process with torch alone; INT8 tables; the serving contract's checks on bad input."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from app.bench.serve import main as bench_main
from app.checkpoint import serving_runtime
from app.checkpoint.export import main as export_main
from app.checkpoint.export_pt2 import (
    SavedWeights, build_serving_module, check_lowerable, constant_bytes, export_program, read_saved_weights, serving_tables,
)  # fmt: skip
from app.checkpoint.package_size import report_package_sizes
from app.checkpoint.serving_graph import DEQUANTIZATION_CODE_BYTES, RowWiseInt8, int8_saving_bytes
from app.checkpoint.serving_runtime import ServingPackage, read_tsv_rows
from app.model.dlrm import build_dlrm, build_dlrm_arguments, table_name
from tests.multiprocess import run_on_ranks
from tests.serve.models import EMBEDDING_DIM, counted_vocabulary, predict_args, write_model_file, written_probabilities

# Two small tables (quantised with the others: a width's tables are stacked and dequantised together).
HASHED_SIZES = [40, 60] + [300] * 24
THRESHOLD = 2
SCRIPT = Path(__file__).with_name("score_without_app.py")


@pytest.fixture(scope="module")
def served(sample, checkpoint_writer, tmp_path_factory) -> dict:
    """A hashed model packaged by the CLI (one AOTInductor compile); a model with a frequency threshold, and a
    trained one in float32 and INT8, as exported programs (the graph the compile takes, without the C++);
    all scored by a process where the app cannot be imported, the first two also by ``predict``."""
    folder = tmp_path_factory.mktemp("served")
    hashed = write_model_file(folder / "hashed.pt", HASHED_SIZES, seed=5)
    vocabulary = counted_vocabulary(sample["train"], THRESHOLD)
    thresholded = write_model_file(folder / "threshold.pt", vocabulary.table_sizes, seed=6, vocabulary=vocabulary)
    # The compile (C++, most of this fixture's time) runs as a user runs it, beside the predictions.
    export = subprocess.Popen([sys.executable, "-m", "app", "export", "--format", "pt2", "--ckpt_path", str(hashed),
                               "--output", str(folder / "hashed.pt2")], stdout=subprocess.PIPE, text=True)  # fmt: skip
    trained = Path(checkpoint_writer["root"]) / "checkpoints" / "step=16.ckpt"
    programs = {"threshold": (thresholded, "none"), "trained_none": (trained, "none"), "trained_int8": (trained, "int8")}
    for name, (source, quantize) in programs.items():
        module = build_serving_module(read_saved_weights(source), quantize, source)
        torch.export.save(export_program(module, torch.device("cpu")), folder / f"{name}.pt2")
    run_on_ranks(1, predict_args(sample["val"], hashed, folder / "predict_hashed", 0), folder)
    run_on_ranks(1, predict_args(sample["val"], thresholded, folder / "predict_threshold", THRESHOLD), folder)
    printed, _ = export.communicate()
    assert export.returncode == 0 and f"as {folder / 'hashed.pt2'}" in printed, printed
    out = folder / "scores.pt"
    command = [sys.executable, str(SCRIPT), serving_runtime.__file__, str(folder / "hashed.pt2"), str(sample["val"]),
               str(out), *(str(folder / f"{name}.pt2") for name in programs)]  # fmt: skip
    subprocess.run(command, check=True, cwd=Path.cwd())
    return {"folder": folder, "package": folder / "hashed.pt2", "hashed": hashed, "scores": torch.load(out),
            "predicted_hashed": written_probabilities(folder / "predict_hashed"),
            "predicted_threshold": written_probabilities(folder / "predict_threshold")}  # fmt: skip


def test_a_process_without_the_app_torchrec_or_fbgemm_scores_as_predict(served):
    scores = served["scores"]
    assert scores["loaded"] == []  # the blocked modules were never loaded
    predicted = served["predicted_hashed"]
    assert predicted.size == 300 and predicted.std() > 0.05  # rows the model tells apart
    # 6 decimals in predictions.tsv: up to 5e-7 of the difference is the file's rounding.
    np.testing.assert_allclose(scores["whole"].numpy(), predicted, rtol=0, atol=1e-5)
    np.testing.assert_allclose(scores["program"]["threshold"].numpy(), served["predicted_threshold"], rtol=0, atol=1e-5)


def test_one_package_scores_batches_of_1_7_and_4096_rows_alike(served):
    scores = served["scores"]
    whole = scores["whole"]
    assert scores["ones"].shape == scores["sevens"].shape == whole.shape
    # Another batch size may take another vectorised path through the same float32 sums.
    torch.testing.assert_close(scores["ones"], whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(scores["sevens"], whole, rtol=0, atol=1e-6)
    assert scores["tiled"].shape == (4096,)
    torch.testing.assert_close(scores["tiled"], whole.repeat(14)[:4096], rtol=0, atol=1e-6)


def test_the_contract_beside_the_package_names_inputs_order_mapping_and_versions(served):
    contract = json.loads((served["folder"] / "hashed.contract.json").read_text())
    assert [(i["name"], i["dtype"], i["shape"]) for i in contract["inputs"]] == [
        ("dense_counts", "int64", ["batch", 13]), ("raw_ids", "int64", ["batch", 26])]  # fmt: skip
    assert contract["inputs"][1]["features"] == [f"C{i}" for i in range(1, 27)]
    assert contract["id_mapping"] == {"kind": "hash", "table_sizes": HASHED_SIZES}
    assert contract["batch_rows"]["min"] == 1 and contract["batch_rows"]["max"] >= 4096
    assert contract["versions"]["torch"] == torch.__version__
    # Rewritten smaller (the scoring tests load this very file from Python and C++): no sources, deflated.
    records = zipfile.ZipFile(served["package"]).infolist()
    assert not [r.filename for r in records if r.filename.endswith(".cpp")]
    assert {r.compress_type for r in records} == {zipfile.ZIP_DEFLATED}


def test_int8_tables_keep_the_auc_of_float32_in_d_plus_3_bytes_a_row(served, sample):
    _, _, labels = read_tsv_rows(sample["val"])
    scored = served["scores"]["program"]  # a trained model's float32 and INT8 graphs, scored without the app
    auc = {q: float(binary_auroc(scored[f"trained_{q}"], labels.long())) for q in ("none", "int8")}
    assert auc["none"] > 0.55  # a model that learned something, so the comparison says something
    assert abs(auc["int8"] - auc["none"]) <= 0.001, auc
    messages: list[str] = []
    hashed = build_serving_module(read_saved_weights(served["hashed"]), "int8", served["hashed"], report=messages.append)
    assert messages == [] and hashed.tables.groups == [(True, list(range(26)))]  # (INT8, its features): all of them
    counted = constant_bytes(hashed)
    rows = sum(HASHED_SIZES)
    # (D + 3) / 4 D of float32: 0.34 at this D of 8, 0.297 at the demo's 16 (at most 0.3 from D = 15).
    assert counted["tables"] == rows * (EMBEDDING_DIM + 3) and counted["tables_float32"] == rows * EMBEDDING_DIM * 4


def test_a_width_whose_tables_save_less_than_their_dequantisation_code_stays_float32():
    generator = torch.Generator().manual_seed(0)
    shapes = [(40, 8), (60, 8), (300, 16), (5000, 1)]  # C1..C4
    state = {f"model.sparse_arch.embedding_bag_collection.embedding_bags.{table_name(feature)}.weight": torch.randn(*shape, generator=generator)
             for feature, shape in zip(DEFAULT_CAT_NAMES, shapes)}  # fmt: skip
    saved = SavedWeights(hyper_parameters={}, state_dict=state, vocabulary_ids=None, frequency_threshold=0, data_layout={}, dense_statistics={})
    messages: list[str] = []
    tables = serving_tables(saved, "int8", report=messages.append)
    assert [isinstance(t, RowWiseInt8) for t in tables] == [False, False, True, False]
    assert int8_saving_bytes(100, 8) == 100 * 21 < DEQUANTIZATION_CODE_BYTES < int8_saving_bytes(300, 16)
    assert messages == [
        "int8: 1 table(s) of width 1 stay float32, too small to quantise usefully: their 5,000 rows would save 0 bytes, "
        f"no more than the {DEQUANTIZATION_CODE_BYTES:,} bytes of compiled code that dequantises them: C4",
        "int8: 2 table(s) of width 8 stay float32, too small to quantise usefully: their 100 rows would save 2,100 bytes, "
        f"no more than the {DEQUANTIZATION_CODE_BYTES:,} bytes of compiled code that dequantises them: C1, C2",
    ]


def test_package_size_splits_the_library_into_code_and_the_constants_its_contract_counts(served, capsys):
    measured = report_package_sizes(str(served["package"]), str(served["package"]))
    assert measured["ratios"] == {"file": 1.0, "tables": 1.0}
    package = measured["packages"]["float32"]
    counted = package["constants"]  # the contract's, by kind
    assert counted["tables"] == counted["tables_float32"] == sum(HASHED_SIZES) * EMBEDDING_DIM * 4
    (library,) = [r["bytes"] for name, r in package["records"].items() if name.endswith(".so")]
    assert package["library"]["code"] + package["library"]["constants"] == library
    # The library's constants are the contract's, each aligned to 64 bytes.
    held = sum(v for k, v in counted.items() if k != "tables_float32")
    assert held <= package["library"]["constants"] <= held + 64 * 64
    assert "int8 / float32: file 1.0000, tables 1.0000" in capsys.readouterr().out


def test_row_wise_int8_is_within_a_step_of_each_row_and_keeps_zero_exact():
    weight = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row: scale 0
    weight[4, :8] = 0.0
    table = RowWiseInt8.of(weight)
    error = (table.dequantized() - weight).abs()
    step = table.scale.float()
    # Half a step, plus where fp16 rounded the scale down by up to 2^-11 the clipped top code (255 steps' worth).
    assert bool((error <= step * (0.5 + 255 * 2**-11) + 1e-7).all())
    assert error[3].max() == 0 and error[4, :8].max() == 0
    assert table.codes.dtype == table.zero_point.dtype == torch.uint8 and table.scale.dtype == torch.float16


@pytest.mark.parametrize(
    ("dense", "ids", "message"),
    [
        (torch.zeros(4, 13), torch.zeros(4, 26, dtype=torch.int64), "input dense_counts: dtype torch.float32, expected torch.int64"),
        (torch.zeros(4, 13, dtype=torch.int64), torch.zeros(4, 25, dtype=torch.int64), "input raw_ids: 25 features, expected 26 (C1..C26)"),
        (torch.zeros(13, dtype=torch.int64), torch.zeros(1, 26, dtype=torch.int64), "input dense_counts: shape (13,), expected (batch, 13)"),
        (torch.zeros(4, 13, dtype=torch.int64), torch.zeros(3, 26, dtype=torch.int64), "input raw_ids: 3 rows, but dense_counts has 4"),
        (torch.zeros(0, 13, dtype=torch.int64), torch.zeros(0, 26, dtype=torch.int64), "input dense_counts: 0 rows, expected 1 to 65536"),
        (np.zeros((2, 13), dtype=np.int64), np.full((2, 26), 2**64 - 1, dtype=np.uint64), "input raw_ids: id 18446744073709551615 is outside int64"),
        (np.zeros((1, 13), dtype=np.int64), [[2**70] * 26], "input raw_ids: a value is outside int64"),
        (np.zeros((1, 13), dtype=np.float64), np.zeros((1, 26), dtype=np.int64), "input dense_counts: dtype float64, expected int64 integers"),
    ],
    ids=["dtype", "feature_count", "shape", "rows_differ", "no_rows", "uint64_id", "python_int_id", "numpy_float"],
)  # fmt: skip
def test_bad_input_is_refused_naming_the_input(served, dense, ids, message):
    package = ServingPackage(served["package"])
    with pytest.raises(ValueError, match=re.escape(message)):
        package.score(dense, ids)


def test_a_damaged_package_is_refused_naming_it_before_torch_loads_it(served, tmp_path):
    package = tmp_path / "hashed.pt2"
    shutil.copyfile(served["package"], package)
    shutil.copyfile(served["folder"] / "hashed.contract.json", tmp_path / "hashed.contract.json")
    recorded = json.loads((tmp_path / "hashed.contract.json").read_text())["package_crc32"]
    data = bytearray(package.read_bytes())  # 64 bytes inverted in the middle, the size unchanged
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64])
    package.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{package}: damaged (CRC-32 ")) as refused:
        ServingPackage(package)
    assert f"its contract hashed.contract.json records {recorded}" in str(refused.value)


def test_a_model_the_export_cannot_lower_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"model.interaction = 'gated' has no plain-torch serving graph \(the pt2 export lowers dot, cat, dcn, projection\)"):
        check_lowerable({"interaction": "gated"}, tmp_path / "model.pt")


def test_the_cli_refuses_int8_for_the_torch_format_and_a_package_name_without_pt2(served, tmp_path, capsys):
    for args, message in (
        (["--quantize", "int8"], "error: quantize = 'int8' needs format = pt2"),
        (["--format", "pt2", "--output", str(tmp_path / "model.bin")], "a pt2 package's name must end in .pt2"),
    ):
        with pytest.raises(SystemExit) as stop:
            export_main(["--ckpt_path", str(served["hashed"]), *args])
        assert stop.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("interaction", ["dot", "cat", "dcn", "projection"])
def test_each_interaction_lowers_to_the_models_own_logits(interaction, sample, tmp_path):
    settings = {"dcn_low_rank_dim": 4} if interaction == "dcn" else {}
    if interaction == "projection":
        settings = {"interaction_branch1_layer_sizes": [16, 16], "interaction_branch2_layer_sizes": [16, 16]}
    path = write_model_file(tmp_path / "model.pt", HASHED_SIZES, seed=7, interaction=interaction, **settings)
    saved = read_saved_weights(path)
    serving = build_serving_module(saved, "none", path)
    dense, ids, _ = read_tsv_rows(sample["val"])
    model = build_dlrm(**build_dlrm_arguments(saved.hyper_parameters), embedding_device="cpu")
    model.load_state_dict({k.removeprefix("model."): v for k, v in saved.state_dict.items()})
    rows = torch.remainder(ids, torch.tensor(HASHED_SIZES))  # what the TSV reader hands the model
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=list(DEFAULT_CAT_NAMES), values=rows.T.flatten(), lengths=torch.ones(rows.numel(), dtype=torch.int32)
    )
    with torch.no_grad():
        expected = torch.sigmoid(model(torch.log1p(dense.clamp_min(0).double()).float(), features).squeeze(-1))
        torch.testing.assert_close(serving(dense, ids), expected, rtol=0, atol=1e-6)


def test_the_cpp_example_builds_against_the_wheels_libtorch_and_scores_as_python(served, sample, tmp_path):
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"no {' and no '.join(missing)} on this machine: the C++ example cannot be built")
    build = tmp_path / "build"
    prefix = f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"
    subprocess.run(["cmake", "-S", "examples/serve_cpp", "-B", str(build), prefix], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    printed = subprocess.run([str(build / "serve_pt2"), str(served["package"]), str(sample["val"])],
                             check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    scored = np.array([float(value) for value in printed])
    np.testing.assert_allclose(scored, served["scores"]["whole"].numpy(), rtol=0, atol=1e-7)  # 9 digits printed


def test_the_serve_bench_prints_latency_throughput_and_ratios_for_every_size(served, sample, tmp_path, capsys):
    output = tmp_path / "bench.json"
    bench_main(["--ckpt_path", str(served["hashed"]), "--rows", str(sample["val"]), "--package", str(served["package"]),
                "--int8", "false", "--calls", "3", "--warmup", "1", "--output_json", str(output)])  # fmt: skip
    printed = capsys.readouterr().out.splitlines()
    result = json.loads(output.read_text())
    assert [(r["rows"], r["path"]) for r in result["records"]] == [
        (rows, path) for rows in (1, 64, 512) for path in ("pt2-fp32", "app-predict")]  # fmt: skip
    for record in result["records"]:
        assert 0 < record["p50_ms"] <= record["p99_ms"] and record["rows_per_s"] > 0
        assert any(line.split()[:2] == [str(record["rows"]), record["path"]] for line in printed)
    assert [r["rows"] for r in result["ratios"]] == [1, 64, 512]
    assert sum("app predict time per row / pt2-fp32" in line for line in printed) == 3
    assert result["max_abs_difference"]["pt2-fp32"] <= 1e-5  # the same model on both paths
