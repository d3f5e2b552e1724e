"""docs/own-data.md's worked example runs as written, on 3,000 rows instead of 200,000: the generator,
fit and predict, with the schema the page shows being the one configs/own_data.yaml holds."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import yaml

from tests.multiprocess import run_on_ranks

DOC = Path("docs/own-data.md")


def worked_example() -> tuple[list[str], dict]:
    """The commands of the page's worked example and the schema it shows."""
    section = DOC.read_text().split("## Worked example", 1)[1].split("\n## ", 1)[0]
    commands = re.search(r"^```bash\n(.*?)^```", section, flags=re.M | re.S).group(1).strip().splitlines()
    shown = yaml.safe_load(re.search(r"^```yaml\n(.*?)^```", section, flags=re.M | re.S).group(1))
    return commands, shown


def _metrics(cli) -> dict:
    return {name: float(value) for name, value in cli.trainer.callback_metrics.items()}


def test_the_worked_example_runs_as_written_on_fewer_rows(tmp_path):
    commands, shown = worked_example()
    assert shown["data"]["schema"] == yaml.safe_load(Path("configs/own_data.yaml").read_text())["data"]["schema"]
    generate, fit, predict = (shlex.split(command) for command in commands)
    assert generate[:2] == ["python", "data/make_own_data.py"]
    assert fit[:4] == ["python", "-m", "app", "fit"] and predict[:4] == ["python", "-m", "app", "predict"]
    files = tmp_path / "own"
    scaled = [files if word == "data/own" else "3000" if word == "200000" else word for word in generate[2:]]
    subprocess.run([sys.executable, generate[1], *map(str, scaled)], check=True, capture_output=True)
    # The page's own files and run folder, moved to the test's folder; fewer rows, same recipe.
    here = ["--data.train", str(files / "train.parquet"), "--data.val", str(files / "val.parquet"),
            "--data.predict", str(files / "predict.parquet"), "--data.cache_dir", str(tmp_path / "cache"),
            "--trainer.default_root_dir", str(tmp_path / "runs"), "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false",
            # The page's 200,000 rows train the demo as it is; on 3,000, fit would take its small-data settings.
            "--small_data.below_rows", "0"]  # fmt: skip
    logged = run_on_ranks(2, fit[3:] + here, tmp_path, _metrics)[0]
    # Both logged (12 steps on 3,000 rows learn little: the values are not the point here).
    assert 0 < logged["val/auc"] < 1 and 0 < logged["val/gauc"] < 1
    run_on_ranks(2, predict[3:] + here, tmp_path)
    lines = (tmp_path / "runs" / "predictions.tsv").read_text().splitlines()
    assert lines[0] == "row_id\tprobability\tuser_id\titem_id" and len(lines) == 1 + 300  # a tenth of the rows
    fields = [line.split("\t") for line in lines[1:]]
    assert [int(f[0]) for f in fields] == list(range(300))
    probabilities = np.array([float(f[1]) for f in fields])
    assert ((probabilities > 0) & (probabilities < 1)).all()
    keys = pq.read_table(files / "predict.parquet", columns=["user_id", "item_id"]).to_pydict()
    assert [f[2] for f in fields] == keys["user_id"] and [f[3] for f in fields] == [str(i) for i in keys["item_id"]]
