# The two commands a fresh clone needs: `make run` and `make test`. Both set up `.venv` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Stamp file: set-up is redone only when a requirements file changes.
STAMP := $(VENV)/.installed
SAMPLE := data/sample/train.tsv

.PHONY: setup run test sample lint bench bench-data clean help

help:
	@echo "make run    - set up .venv and train the demo (2 CPU processes, sharded embeddings)"
	@echo "make test   - set up .venv and run the whole test suite"
	@echo "make setup  - only create .venv and install the pinned stack"
	@echo "make sample - only generate the bundled Criteo-format sample in data/sample/"
	@echo "make lint   - lint the Dockerfile with hadolint"
	@echo "make bench  - the app against a plain TorchRec loop, side by side (JSON lines; BENCH_ARGS=\"--preset NAME ...\")"
	@echo "make bench-data - data-path figures: raw->NumPy vs pandas, batches vs training, first vs cached fit, memory at 1M vs 10M rows (minutes)"

setup: $(STAMP)

$(STAMP): requirements.txt requirements-torchrec.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# torch first and alone, so nothing can resolve it to another build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-torchrec.txt
	$(PY) -c "import torch, fbgemm_gpu, torchrec, lightning, torchmetrics; print('stack ok: torch', torch.__version__)"
	touch $(STAMP)

sample: $(SAMPLE)

$(SAMPLE): $(STAMP) data/make_sample.py app/data/synthetic.py
	$(PY) data/make_sample.py --output data/sample

run: setup sample
	$(PY) -m app fit --config configs/demo.yaml

test: setup lint
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/hadolint Dockerfile

# Extra arguments for python -m app.bench, e.g. BENCH_ARGS="--preset gaudi_medium --run.measured_steps 5".
BENCH_ARGS ?=
bench: setup
	$(PY) -m app.bench $(BENCH_ARGS)

bench-data: setup
	$(PY) data/bench_data.py

clean:
	rm -rf $(VENV) data/sample runs .pytest_cache
