"""`make bench` runs the app and the plain TorchRec loop side by side and prints JSON lines with the ratio,
on random batches or on a real dataset read by the app's data module (both sides the same batches);
a configuration that cannot run is refused before any process starts, naming the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.bench import cli as bench_cli
from app.bench.cli import main
from app.bench.dataset import read_dataset
from app.bench.measure import step_statistics
from app.bench.settings import check_can_run
from app.bench.trained_batches import TrainedBatches
from app.data.datamodule import CriteoDataModule
from app.data.dataset import CriteoBatches
from app.data.synthetic import write_synthetic_criteo
from app.train.precision import default_precision

TINY = [
    "--preset", "demo", "--run.warmup_steps", "2", "--run.measured_steps", "4",
    "--data.rows_per_table", "1000", "--data.batch_size_per_rank", "64", "--data.ids_per_lookup", "2",
]  # fmt: skip


def test_make_bench_prints_a_json_line_per_run_and_the_ratio(tmp_path):
    # -o: never redo the environment's set-up from inside a test; the test's interpreter runs the bench.
    bench_args = " ".join([*TINY, "--run.output_dir", str(tmp_path)])
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "bench", f"PY={sys.executable}", f"BENCH_ARGS={bench_args}",
         "BENCH_QUALITY=0"],  # the quality guard has its own test (tests/bench/test_quality_guard.py)
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [line.get("run") for line in lines] == ["app", "raw", None]
    for line in lines[:2]:
        assert line["world_size"] == 2 and line["global_batch_size"] == 128 and line["measured_steps"] == 4
        assert line["threads_per_rank"] == [line["threads_per_rank"][0]] * 2
        assert line["samples_per_s_median"] > 0 and 0 < line["step_ms_p50"] <= line["step_ms_p90"] <= line["step_ms_p99"]
        assert [m["rank"] for m in line["peak_memory_per_rank"]] == [0, 1]
        assert line["config"]["data"]["ids_per_lookup"] == 2 and line["versions"]["torchrec"]
        # No kernels apart from the host on CPU: the GPU fields are there, null, with the reason.
        assert line["gpu_busy_fraction"] is None and line["host_ms_per_step_outside_kernels"] is None
        assert line["gpu_busy_reason"].startswith("cpu run: ")
    # The app trains in its default precision on this machine (tests/train/test_precision.py), the raw loop in float32.
    assert lines[0]["config"]["precision"] == (default_precision("cpu")[0] or "32-true")
    assert lines[1]["config"]["precision"] == "32-true"
    summary = lines[2]
    assert summary["summary"] is True and summary["same_plan"] is True and summary["same_batches"] is True
    assert {key: summary[key] for key in summary if "gpu_busy" in key or "outside_kernels" in key} == {
        f"{run}_{field}_median": None for run in ("app", "raw") for field in ("gpu_busy_fraction", "host_ms_per_step_outside_kernels")
    }
    assert summary["ratio_app_over_raw"] == pytest.approx(lines[0]["samples_per_s_median"] / lines[1]["samples_per_s_median"])
    assert summary["step_ms_p50_app_minus_raw"] == pytest.approx(lines[0]["step_ms_p50"] - lines[1]["step_ms_p50"])
    assert (tmp_path / "sharding_plan.json").is_file()  # the app's record of its plan, in the bench's folder


@pytest.mark.parametrize("preset", sorted(path.stem for path in bench_cli.PRESETS_DIR.glob("*.yaml")))
def test_every_preset_parses_and_can_run_here(preset):
    # The checks made before any process starts; a preset that names a removed setting fails here.
    spec = bench_cli.spec_from(bench_cli.build_parser().parse_args(bench_cli.expand_presets(["--preset", preset])))
    assert spec.name == preset
    check_can_run(spec)


@pytest.mark.parametrize(
    "args, setting",
    [
        (["--strategy.sharding_types", "[row_wise]"], "strategy.sharding_types: 'row_wise' is not available on cpu"),
        (["--model.sparse_optimizer", "adam"], "model.sparse_optimizer: Adam has no CPU embedding kernel"),
        (["--data.rows_per_table", str(10**12)], "data.rows_per_table = 1000000000000: the tables with their"),
        (["--data.ids_per_lookup", "[1, 2]"], "data.ids_per_lookup = [1, 2]: give one positive int, or one per table"),
        (["--app_variants", '{"fast": {"no_such_setting": 1}}'], "app_variants.fast.no_such_setting is neither a model setting"),
        (["--app_variants", '{"fast": {"strategy": {"no_such": 1}}}'], "app_variants.fast.strategy.no_such is not a strategy setting"),
        (["--app_variants", '{"half": {"precision": "16-mixed"}}'], "app_variants.half.precision = 16-mixed: the app applies"),
        (["--run.precision", "bf16-true"], "run.precision = bf16-true: the app applies 32-true or bf16-mixed"),
        (["--app_variants", '{"bar": {"progress_bar_refresh_rate": -1}}'], "app_variants.bar.progress_bar_refresh_rate = -1: give a whole"),
        (
            ["--app_variants", '{"graphs": {"compile": true, "compile_mode": "reduce-overhead"}}'],
            "app_variants.graphs.compile_mode = reduce-overhead replays the dense layers as CUDA graphs, which need a CUDA GPU",
        ),
        (["--model.compile_mode", "max-autotune"], "model.compile_mode = max-autotune applies to compiled dense layers"),
        (
            ["--app_variants", '{"uvm": {"strategy": {"table_constraints": {"t_cat_0": {"compute_kernels": ["fused_uvm_caching"]}}}}}'],
            "app_variants.uvm.strategy.table_constraints.t_cat_0.compute_kernels: 'fused_uvm_caching' is not available on cpu",
        ),
        (
            ["--app_variants", '{"uvm": {"strategy": {"table_constraints": {"t_cat_0": {"cache_factor": 0.2}}}}}'],
            "app_variants.uvm.strategy.table_constraints.t_cat_0: unknown field(s) ['cache_factor']; fields: sharding_types,",
        ),
        (["--preset", "no_such_preset"], "--preset 'no_such_preset'"),
    ],
)
def test_bad_configuration_is_refused_before_any_process_starts(args, setting, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "torchrec_reference", *args])
    assert exit_info.value.code == 2
    assert setting in capsys.readouterr().err


def _dataset_args(train: Path, tmp_path: Path) -> list[str]:
    """A real dataset through the app's data module: 512 rows per rank, 5 batches per epoch of the
    4,571 Kaggle rows on 2 processes, so the 6 steps run into a second (reshuffled) epoch."""
    return [
        "--preset", "demo", "--run.warmup_steps", "2", "--run.measured_steps", "4", "--run.output_dir", str(tmp_path),
        "--dataset.train", str(train), "--dataset.batch_size", "512", "--dataset.num_embeddings_per_feature", "auto",
        "--dataset.cache_dir", str(tmp_path / "cache"), "--dataset.cache_workers", "1",  # not beside the shared rows
    ]  # fmt: skip


def test_both_sides_train_on_the_same_batches_of_a_real_tsv_dataset(shared_criteo, tmp_path):
    train = shared_criteo / "kaggle_train_4571.tsv"
    lines = main(_dataset_args(train, tmp_path))
    assert [line.get("run") for line in lines] == ["app", "raw", None]
    app, raw, summary = lines
    for line in (app, raw):
        assert line["global_batch_size"] == 1024 and line["measured_steps"] == 4
        assert "data" not in line["config"] and line["config"]["dataset"]["train"] == str(train)
        read = line["config"]["dataset_read"]
        assert read["rows"] == 4571 and read["batches_per_epoch_per_rank"] == 5 and read["ids_per_lookup"] == [1.0] * 26
        assert len(read["table_sizes"]) == 26 and max(read["table_sizes"]) <= 4571  # auto: distinct ids per feature
        assert all(m["expected_bytes"] > 0 for m in line["peak_memory_per_rank"])
    assert summary["same_plan"] is True and summary["same_batches"] is True
    assert summary["ratio_app_over_raw"] == pytest.approx(app["samples_per_s_median"] / raw["samples_per_s_median"])
    # The bench converted into dataset.cache_dir (whatever a run without it left beside the shared rows) ...
    (converted,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert list(converted.glob("day_0_*.npy"))
    # ... and, not merely equal: the batches the data module gives each rank, epoch after epoch as Lightning runs them.
    assert app["batches_checksum_per_rank"] == _expected_checksums(tmp_path / "cache", train, world_size=2, steps=6)


def _expected_checksums(cache_dir: Path, train: Path, world_size: int, steps: int) -> list[str]:
    data = CriteoDataModule(train=str(train), batch_size=512, num_embeddings_per_feature=1000, cache_dir=str(cache_dir))
    data.setup("fit")  # the cache the bench made; one process: all the rows, as each rank addresses them
    source = data.datasets["train"].source
    checksums = []
    for rank in range(world_size):
        batches = CriteoBatches(source, 512, rank, world_size, shuffle=True, seed=0, drop_remainder=True)
        trained = TrainedBatches()
        for step in range(steps):
            trained.add(batches[divmod(step, len(batches))])  # (epoch, batch): the epoch sets the shuffle
        checksums.append(trained.checksum())
    return checksums


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset.train", "{tmp}/missing.tsv"], "dataset.train: data file or directory '{tmp}/missing.tsv' does not exist"),
        (["--dataset.train", "{tmp}/rows.tsv", "--dataset.format", "numpy"], "dataset.train: {tmp}/rows.tsv: data directory"),
        (["--dataset.train", "{tmp}", "--dataset.format", "multi_hot"], "dataset.train: {tmp}: no day_*_sparse_multi_hot.npz"),
        (["--dataset.split", "kaggle", "--dataset.root", "{tmp}/missing.tsv"], "dataset.root: {tmp}/missing.tsv does not exist"),
        (["--dataset.batch_size", "256"], "dataset.batch_size is set, but no dataset.train or dataset.split"),
        (["--dataset.train", "{tmp}/small.tsv", "--dataset.cache_dir", "{tmp}/cache", "--dataset.cache_workers", "1"],
         "dataset.train has 100 training rows, fewer than one global batch of dataset.batch_size = 4096 x run.world_size = 2"),
    ],
)
def test_a_bad_dataset_is_refused_before_any_process_starts(args, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "rows.tsv").write_text("")
    write_synthetic_criteo(tmp_path / "small.tsv", num_rows=100, seed=3)
    monkeypatch.setattr(bench_cli, "run_on_ranks", _no_process_may_start)
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "demo", *(arg.format(tmp=tmp_path) for arg in args)])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.splitlines()[-1]  # after the converter's report, if it converted
    assert last_line.startswith("error: ") and message.format(tmp=tmp_path) in last_line, last_line


def _no_process_may_start(*args, **kwargs):
    raise AssertionError("a run started")


def test_multi_hot_days_give_their_bag_sizes_as_pooling_factors(tmp_path):
    from app.data.multi_hot import main as to_multi_hot
    from app.data.preprocess import main as preprocess

    write_synthetic_criteo(tmp_path / "train.tsv", num_rows=300, seed=5)
    assert preprocess(["--input", str(tmp_path / "train.tsv"), "--output", str(tmp_path / "npy"), "--workers", "1"]) == 0
    bags = [1, 2, 3] * 8 + [4, 5]
    assert to_multi_hot([
        "--input", str(tmp_path / "npy"), "--output", str(tmp_path / "mh"),
        "--num_embeddings_per_feature", f"[{','.join(['100'] * 26)}]", "--multi_hot_sizes", f"[{','.join(map(str, bags))}]",
    ]) == 0  # fmt: skip
    settings = {"train": str(tmp_path / "mh"), "batch_size": 64, "num_embeddings_per_feature": 100}
    dataset = read_dataset(settings, world_size=2)
    assert dataset.ids_per_lookup == bags and dataset.rows == 300
    assert dataset.batches_per_epoch == 3  # 300 rows in global batches of 128: 2 full, and 44 rows split in two
    one = CriteoDataModule(**settings)
    one.setup("fit")
    batch = one.datasets["train"][(0, 0)]
    kjt = batch.sparse_features
    tensors = (batch.dense_features, batch.labels, batch.row_ids, kjt.values(), kjt.lengths())
    assert dataset.batch_bytes() == sum(t.numel() * t.element_size() for t in tensors)  # what a batch holds


def test_variants_settings_reach_their_runs_and_a_progress_bar_draws_on_standard_error_only(tmp_path, capfd):
    # Two variants beside the app's run in one bench (each its own processes, as the bench always runs them).
    # cw: the bench reads a variant's strategy settings as JSON, and each table constraint must reach the
    # strategy as the TableConstraint it takes (a plain dict failed inside the workers).
    # bar: a variant with a progress bar draws it on standard error; standard output stays JSON lines.
    variants = {"cw": {"strategy": {"table_constraints": {"t_cat_0": {"sharding_types": ["column_wise"]}}}},
                "bar": {"progress_bar_refresh_rate": 1}}  # fmt: skip
    lines = main([*TINY, "--run.sides", "[app]", "--run.output_dir", str(tmp_path), "--app_variants", json.dumps(variants)])
    assert [line.get("run") for line in lines] == ["app", "cw", "bar", None]
    plans = {line["run"]: line["plan"] for line in lines[:3]}
    t_cat_0 = {run: [row.split()[:2] for row in plan.splitlines() if row.startswith("t_cat_0 ")] for run, plan in plans.items()}
    assert t_cat_0 == {"app": [["t_cat_0", "table_wise"]], "cw": [["t_cat_0", "column_wise"]], "bar": [["t_cat_0", "table_wise"]]}
    assert lines[3]["variants_with_another_plan"] == ["cw"]
    captured = capfd.readouterr()
    # 6 steps (TINY: 2 warm-up, 4 measured), each redrawn (Lightning draws on stdout; a rank's stdout is the bench's stderr).
    assert [f"{step}/6" in captured.err for step in range(1, 7)] == [True] * 6, captured.err[-2000:]
    assert [json.loads(line).get("run", "summary") for line in captured.out.splitlines()] == ["app", "cw", "bar", "summary"]


def test_same_plan_compares_the_default_app_run_with_the_plain_loop_and_names_variants_with_their_own():
    spec = bench_cli.spec_from(bench_cli.build_parser().parse_args(bench_cli.expand_presets(["--preset", "demo"])))

    def line(run: str, plan: str) -> dict:
        memory = [{"growth_over_expected": 1.0}]
        return {"run": run, "plan": plan, "samples_per_s_median": 100.0, "step_ms_p50": 1.0,
                "batches_checksum_per_rank": ["12:0abc"], "peak_memory_per_rank": memory}  # fmt: skip

    lines = [line("app", "P"), line("raw", "P"), line("app_uvm_caching", "Q"), line("app_compiled", "P")]
    summary = bench_cli.summary_line(spec, lines)
    assert summary["same_plan"] is True and summary["variants_with_another_plan"] == ["app_uvm_caching"]
    summary = bench_cli.summary_line(spec, [line("app", "P"), line("raw", "Q")])
    assert summary["same_plan"] is False and summary["variants_with_another_plan"] == []


def test_samples_per_s_counts_the_rows_each_step_trained():
    # A dataset's last batch of an epoch is short: counting it as a full batch would inflate samples/s.
    stats = step_statistics([0.5, 0.5, 0.25], [1024, 1024, 128])
    assert stats["samples_per_s_mean"] == pytest.approx(2176 / 1.25)
    assert stats["samples_per_s_median"] == pytest.approx(2048)


def test_a_steps_working_set_is_measured_on_the_model_and_scales_with_the_batch():
    from app.bench.measure import autograd_working_set_bytes

    model = {"interaction": "dot", "embedding_dim": 8, "dense_arch_layer_sizes": [32, 8], "over_arch_layer_sizes": [16, 1]}
    one_id, two_ids = autograd_working_set_bytes(model, 64, [1.0] * 26), autograd_working_set_bytes(model, 64, [2.0] * 26)
    # Saved activations are per row (a few index tensors hold one element more): twice the rows, twice
    # the bytes, to 2 %; weights are never counted.
    assert autograd_working_set_bytes(model, 128, [1.0] * 26) == pytest.approx(2 * one_id, rel=0.02)
    # The bottom MLP alone saves its input and both layers' outputs (64 x (13 + 32 + 8) float32),
    # counted twice (activations, then their gradients): a lower bound of the whole step.
    assert one_id > 2 * 64 * (13 + 32 + 8) * 4
    assert two_ids >= one_id  # larger bags never need less


def test_memory_on_cpu_is_resident_memory_and_on_gpus_the_hbm_peak_is_compared():
    from app.bench.measure import growth_over_expected, peak_memory, rss_bytes

    cpu = peak_memory(torch.device("cpu"), rss_bytes())
    assert set(cpu) == {"peak_rss_bytes", "rss_growth_bytes", "basis"} and cpu["basis"] == "rss"  # no HBM figures on CPU
    hbm = {"hbm_allocated_at_measure_start_bytes": 250, "peak_hbm_allocated_bytes": 300, "peak_hbm_reserved_bytes": 512}
    gpu = peak_memory(torch.device("cuda", 0), 0, hbm)  # reads no device: the figures come from the clock
    assert gpu["basis"] == "hbm" and {k: gpu[k] for k in hbm} == hbm
    # On a GPU the tables live in HBM: its peak over the measured steps is compared, not RSS (the CUDA context).
    assert growth_over_expected({**gpu, "rss_growth_bytes": 10**9, "expected_bytes": 200}) == 1.5
    assert growth_over_expected({"basis": "rss", "rss_growth_bytes": 110, "expected_bytes": 100}) == pytest.approx(1.1)


def test_random_batches_are_pinned_for_a_gpu_run_only():
    from app.bench.app_side import _data_module
    from app.bench.data import RandomBatches, RandomData, pins_batches

    assert pins_batches(torch.device("cuda", 1)) and not pins_batches(torch.device("cpu"))
    spec = bench_cli.spec_from(bench_cli.build_parser().parse_args(bench_cli.expand_presets(["--preset", "demo"])))
    # The app's side decides by the run's device (no batch is built here, so no GPU is needed).
    assert _data_module(spec, 0, torch.device("cuda", 0)).pin_memory is True
    assert _data_module(spec, 0, torch.device("cpu")).pin_memory is False
    pool = RandomBatches(RandomData(num_tables=2, rows_per_table=10, batch_size_per_rank=4, num_generated_batches=2), 3, 0).pool
    assert not any(batch.dense_features.is_pinned() for batch in pool)


def _plan(rows_per_rank: tuple[int, int], kernel: str = "fused", cache_load_factor: float | None = None):
    """t_a (100 x 8) split row-wise 60/40 over ranks 0 and 1 with ``kernel``; t_b (50 x 8) replicated (data-parallel)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    rank0_rows, rank1_rows = rows_per_rank
    row_wise = EnumerableShardingSpec([
        ShardMetadata([0, 0], [rank0_rows, 8], "rank:0/cpu"), ShardMetadata([rank0_rows, 0], [rank1_rows, 8], "rank:1/cpu"),
    ])  # fmt: skip
    return ShardingPlan({"sparse": EmbeddingModuleShardingPlan({
        "t_a": ParameterSharding(
            sharding_type="row_wise", compute_kernel=kernel, ranks=[0, 1], sharding_spec=row_wise,
            cache_params=None if cache_load_factor is None else CacheParams(load_factor=cache_load_factor),
        ),
        "t_b": ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1], sharding_spec=None),
    })})  # fmt: skip


def test_embedding_bytes_per_step_count_each_looked_up_row_and_its_state_from_the_plan():
    from app.bench.measure import embedding_bytes_per_step, hbm_bandwidth_share

    plan, shapes, ids = _plan((60, 40)), {"t_a": (100, 8), "t_b": (50, 8)}, {"t_a": 2.0, "t_b": 1.0}
    # Rank 0, 10 rows per rank on 2 ranks, rows of 8 float32 (32 bytes):
    # t_a, row-wise: the global 20 bags, 60 % of their 40 ids = 24 ids; forward reads 24 rows and writes
    #   20 bags, backward reads 20 bag gradients and reads and writes 24 rows with their state;
    # t_b, replicated: the rank's own 10 bags of 1 id.
    sgd = (24 * 32 + 2 * 20 * 32 + 2 * 24 * 32) + (10 * 32 + 2 * 10 * 32 + 2 * 10 * 32)
    assert embedding_bytes_per_step(plan, 0, shapes, ids, 10, 2, "sgd") == sgd == 5184
    adagrad = (24 * 32 + 2 * 20 * 32 + 2 * 24 * 64) + (10 * 32 + 2 * 10 * 32 + 2 * 10 * 64)  # + a float per element
    assert embedding_bytes_per_step(plan, 0, shapes, ids, 10, 2, "adagrad") == adagrad == 7360
    assert embedding_bytes_per_step(plan, 1, shapes, ids, 10, 2, "sgd") == 16 * 32 + 2 * 20 * 32 + 2 * 16 * 32 + 1600
    # 7,360 bytes in 1 microsecond of kernels on a 3,350 GB/s device: 7.36e9 / 3.35e12 of the bandwidth.
    assert hbm_bandwidth_share(7360, 1e-3, 3350.0) == pytest.approx(7.36e9 / 3.35e12)
    assert hbm_bandwidth_share(7360, 0.0, 3350.0) is None  # no kernel time recorded: no figure


def test_the_memory_a_rank_must_hold_counts_a_uvm_tables_hbm_cache_not_its_rows():
    from app.bench.measure import expected_memory_bytes

    shapes = {"t_a": (100, 8), "t_b": (50, 8)}

    def tables_only(plan, optimizer: str) -> int:
        return expected_memory_bytes(plan, 0, shapes, optimizer, 0, "sgd", 0)

    # Rank 0 holds 60 rows of t_a (8 float32 = 32 bytes each) and t_b whole, twice (with its gradient);
    # row-wise Adagrad adds a float per row, Adam two floats per element.
    replicated_rwa, replicated_adam = 2 * 50 * 32 + 50 * 4, 2 * 50 * 32 * 3
    assert tables_only(_plan((60, 40)), "row_wise_adagrad") == 60 * 32 + 60 * 4 + replicated_rwa == 5560
    assert tables_only(_plan((60, 40)), "adam") == 60 * 32 * 3 + replicated_adam
    # UVM caching keeps the rows (and per-element state) in host memory; in HBM: the cache, a load
    # factor of the rows, each slot with its row and 16 bytes of cache state, an int32 per row, and the
    # row-wise state.
    cached = _plan((60, 40), "fused_uvm_caching", 0.5)
    assert tables_only(cached, "row_wise_adagrad") == 30 * (32 + 16) + 60 * 4 + 60 * 4 + replicated_rwa == 5320
    assert tables_only(cached, "adam") == 30 * (32 + 16) + 60 * 4 + replicated_adam
    default_cache = _plan((60, 40), "fused_uvm_caching")  # TorchRec's and FBGEMM's load factor, 0.2
    assert tables_only(default_cache, "row_wise_adagrad") == 12 * (32 + 16) + 60 * 4 + 60 * 4 + replicated_rwa
    assert tables_only(_plan((60, 40), "fused_uvm"), "row_wise_adagrad") == 60 * 4 + replicated_rwa  # no cache


def test_the_phase_table_of_a_gpu_run_keeps_host_and_device_time_apart():
    from app.bench.phases import DENSE, HOST_REST_ON_GPU, PYTHON, phase_table_ms

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(2):
            model(torch.randn(32, 64)).sum().backward()
            optimizer.step()
    events = list(profiler.events())
    host_only = phase_table_ms(events, wall_ms=1e6, num_steps=2)
    assert host_only[DENSE] > 0 and host_only["optimizer"] > 0 and PYTHON in host_only
    split = phase_table_ms(events, wall_ms=1e6, num_steps=2, device_time=True)
    assert set(split) == {"host_ms", "device_ms", "wall_ms"} and split["wall_ms"] == 5e5
    # The host's side is the same table, its rest named for what it is on a GPU (Python, or a wait).
    assert split["host_ms"] == {**{k: v for k, v in host_only.items() if k != PYTHON}, HOST_REST_ON_GPU: host_only[PYTHON]}
    assert set(split["device_ms"]) == set(host_only) - {PYTHON}
    assert all(ms == 0 for ms in split["device_ms"].values())  # no kernel ran: a CPU profile has no device time


def test_kernel_busy_time_counts_overlapping_kernels_once_and_ignores_the_host():
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from app.bench.phases import kernel_busy_ms

    def event(start_us: int, end_us: int, device_type: DeviceType) -> FunctionEvent:
        return FunctionEvent(0, "k", 0, start_us, end_us, device_type=device_type)

    kernels = [event(0, 1000, DeviceType.CUDA), event(500, 1500, DeviceType.CUDA), event(3000, 3250, DeviceType.CUDA)]
    host = [event(0, 10_000, DeviceType.CPU)]  # a host op spanning everything is no kernel time
    # [0, 1.5 ms] on two streams counts once, then 0.25 ms: 1.75 ms busy in all.
    assert kernel_busy_ms(host + kernels[::-1]) == 1.75
    assert kernel_busy_ms(host) == 0.0


def test_gpu_busy_fraction_is_kernel_time_over_the_measured_steps_wall_time():
    from app.bench.measure import gpu_busy

    steps_s = [0.004, 0.006, 0.005]  # a mean of 5 ms a step
    busy = gpu_busy("cuda", profile_steps=5, step_times_s=steps_s, kernel_busy_ms_per_step=3.5)
    assert busy["gpu_busy_fraction"] == pytest.approx(0.7) and busy["host_ms_per_step_outside_kernels"] == pytest.approx(1.5)
    assert busy["kernel_ms_per_step"] == 3.5 and busy["gpu_busy_reason"] is None
    unprofiled = gpu_busy("cuda", profile_steps=0, step_times_s=steps_s, kernel_busy_ms_per_step=None)
    assert unprofiled["gpu_busy_fraction"] is None and "run.profile_steps" in unprofiled["gpu_busy_reason"]
    on_cpu = gpu_busy("cpu", profile_steps=5, step_times_s=steps_s, kernel_busy_ms_per_step=None)
    assert on_cpu["gpu_busy_fraction"] is None and on_cpu["host_ms_per_step_outside_kernels"] is None
    assert on_cpu["gpu_busy_reason"].startswith("cpu run: ")
