"""Write the bundled synthetic Criteo-format sample (``make sample``).

The sample stands in for the real Criteo click logs, which cannot be redistributed: raw TSV in
the exact Criteo layout (``label, I1..I13, C1..C26``, tab-separated, empty = missing, ids as
8 hex digits), drawn from one fixed synthetic "world" with a planted click signal (see
``app/data/synthetic.py``). All four files share that world, so a model trained on ``train.tsv``
can be validated and tested on the others; the best possible AUC is about 0.80.

    train.tsv    200,000 rows, seed 1
    val.tsv       20,000 rows, seed 2
    test.tsv      20,000 rows, seed 3
    predict.tsv    5,000 rows, seed 4, unlabelled (39 fields, like Kaggle's test.txt)

The files are byte-identical from run to run. Usage, from the repository root:

    python data/make_sample.py --output data/sample
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from app.data.synthetic import write_synthetic_criteo  # noqa: E402

# (file name, rows, seed, labelled). train.tsv last: `make` takes it as the sign of a whole sample.
SPLITS = (
    ("val.tsv", 20_000, 2, True),
    ("test.tsv", 20_000, 3, True),
    ("predict.tsv", 5_000, 4, False),
    ("train.tsv", 200_000, 1, True),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("data/sample"), help="folder to write")
    args = parser.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    for name, num_rows, seed, labelled in SPLITS:
        final = args.output / name
        partial = final.with_name(name + ".partial")  # never leave a half-written file behind
        summary = write_synthetic_criteo(partial, num_rows=num_rows, seed=seed, labelled=labelled)
        os.replace(partial, final)
        labels = f"{summary.positive_rate:.1%} clicks" + ("" if labelled else " (labels not written)")
        print(f"{final}: {num_rows:,} rows, {labels}, Bayes-optimal AUC {summary.bayes_auc:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
