"""`make bench` runs the app and the plain TorchRec loop side by side and prints JSON lines with the ratio;
a configuration that cannot run is refused before any process starts, naming the setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.cli import main
from app.bench.measure import step_statistics

TINY = [
    "--preset", "demo", "--run.warmup_steps", "2", "--run.measured_steps", "4",
    "--data.rows_per_table", "1000", "--data.batch_size_per_rank", "64", "--data.ids_per_lookup", "2",
]  # fmt: skip


def test_make_bench_prints_a_json_line_per_run_and_the_ratio(tmp_path):
    # -o: never redo the environment's set-up from inside a test; the test's interpreter runs the bench.
    bench_args = " ".join([*TINY, "--run.output_dir", str(tmp_path)])
    result = subprocess.run(
        ["make", "--no-print-directory", "-o", ".venv/.installed", "bench", f"PY={sys.executable}", f"BENCH_ARGS={bench_args}"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1],
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
    summary = lines[2]
    assert summary["summary"] is True and summary["same_plan"] is True and summary["same_batches"] is True
    assert summary["ratio_app_over_raw"] == pytest.approx(lines[0]["samples_per_s_median"] / lines[1]["samples_per_s_median"])
    assert (tmp_path / "sharding_plan.json").is_file()  # the app's record of its plan, in the bench's folder


@pytest.mark.parametrize(
    "args, setting",
    [
        (["--strategy.sharding_types", "[row_wise]"], "strategy.sharding_types: 'row_wise' is not available on cpu"),
        (["--model.sparse_optimizer", "adam"], "model.sparse_optimizer: Adam has no CPU embedding kernel"),
        (["--data.rows_per_table", str(10**12)], "data.rows_per_table = 1000000000000: the tables with their"),
        (["--data.ids_per_lookup", "[1, 2]"], "data.ids_per_lookup = [1, 2]: give one positive int, or one per table"),
        (["--app_variants", '{"fast": {"no_such_setting": 1}}'], "app_variants.fast.no_such_setting is not a model setting"),
        (["--preset", "no_such_preset"], "--preset 'no_such_preset'"),
    ],
)
def test_bad_configuration_is_refused_before_any_process_starts(args, setting, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "torchrec_reference", *args])
    assert exit_info.value.code == 2
    assert setting in capsys.readouterr().err


def test_samples_per_s_counts_the_rows_each_step_trained():
    # A dataset's last batch of an epoch is short: counting it as a full batch would inflate samples/s.
    stats = step_statistics([0.5, 0.5, 0.25], [1024, 1024, 128])
    assert stats["samples_per_s_mean"] == pytest.approx(2176 / 1.25)
    assert stats["samples_per_s_median"] == pytest.approx(2048)
