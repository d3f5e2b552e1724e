# The two commands a fresh clone needs: `make run` and `make test`. Both set up `.venv` first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Stamp file: set-up is redone only when a requirements file changes.
STAMP := $(VENV)/.installed
SAMPLE := data/sample/train.tsv

.PHONY: setup run test test-gpu gpu-report test-compat test-compat-oldest test-compat-cudaimage test-compat-newest sample lint bench bench-data bench-quality clean help

help:
	@echo "make run    - set up .venv and train the demo (2 CPU processes, sharded embeddings)"
	@echo "make test   - set up .venv and run the whole test suite"
	@echo "make setup  - only create .venv and install the pinned stack (DEVICE=cuda: the CUDA builds)"
	@echo "make test-compat - the multi-process tests on the oldest, the CUDA image's and the newest supported stack"
	@echo "make test-gpu - the GPU checks (tests/gpu, about 10 min on one GPU; each skips with its reason without one); report in runs/gpu-report.json"
	@echo "make gpu-report - for a short GPU allocation: the GPU checks, then the GPU bench at 4,096 and 16,384 rows, each under its own deadline within GPU_BUDGET_S (600) seconds; every figure in GPU_REPORT_DIR (runs/gpu-report)"
	@echo "make sample - only generate the bundled Criteo-format sample in data/sample/"
	@echo "make lint   - lint the Dockerfile with hadolint"
	@echo "make bench  - the app and each speed lever against a plain TorchRec loop, side by side, then the demo's AUC with and without each lever (JSON lines; BENCH_ARGS=\"--preset NAME ...\", BENCH_QUALITY=0)"
	@echo "make bench-data - data-path figures: raw->NumPy vs pandas, batches vs training, first vs cached fit, memory at 1M vs 10M rows (minutes)"
	@echo "make bench-quality - the demo recipe beside a logistic-regression baseline on the bundled sample: val AUC, log loss, NE, calibration, best epoch, the generator's best AUC (JSON lines, minutes; QUALITY_BENCH_ARGS=\"--recipe FILE --train ... --val ...\")"

setup: $(STAMP)

# cpu (default) or cuda: which builds of torch and fbgemm-gpu `setup` installs. It counts only when
# .venv is (re)installed: `make run` / `make test` keep what is there; `make clean` to switch.
DEVICE ?= cpu
ifeq ($(filter $(DEVICE),cpu cuda),)
$(error DEVICE=$(DEVICE): use cpu or cuda)
endif

$(STAMP): requirements.txt requirements-torchrec.txt requirements-dev.txt requirements-cuda.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# torch first and alone, so nothing can resolve it to another build.
	$(PY) -m pip install --quiet torch==2.13.0
ifeq ($(DEVICE),cuda)
	# PyPI's Linux torch 2.13.0 is the CUDA 13.0 build; PyPI's fbgemm-gpu 1.8.0 is built against it.
	$(PY) -c "import sys, torch; sys.exit(0 if torch.version.cuda else f'DEVICE=cuda: torch {torch.__version__} is a CPU build')"
	grep -v '^fbgemm-gpu-cpu==' requirements.txt > $(VENV)/requirements-without-cpu-fbgemm.txt
	$(PY) -m pip install --quiet -r $(VENV)/requirements-without-cpu-fbgemm.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-cuda.txt
else
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
endif
	$(PY) -m pip install --quiet --no-deps -r requirements-torchrec.txt
	$(PY) -c "import torch, fbgemm_gpu, torchrec, lightning, torchmetrics; print('stack ok: torch', torch.__version__)"
	touch $(STAMP)

sample: $(SAMPLE)

$(SAMPLE): $(STAMP) data/make_sample.py app/data/synthetic.py
	$(PY) data/make_sample.py --output data/sample

run: setup sample
	$(PY) -m app fit --config configs/demo.yaml

# Test files run in parallel, one whole file per worker (pytest-xdist's loadfile: a file's session
# fixtures, such as a 2-process checkpoint writer, are built once per worker, not once per test). Most
# tests start 2-3 app processes and wait on their start-up, so 2 workers on 2 cores cut the suite from
# 11 min 44 s to 7 min 45 s (2026-11-26). Capped at 4: more workers start more processes than memory
# and cores hold. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; cores = getattr(os, 'sched_getaffinity', None); print(min(len(cores(0)) if cores else os.cpu_count() or 1, 4))")
# PYTHONDONTWRITEBYTECODE emptied: the app's compiled modules are kept in __pycache__ (ignored by git) even
# where the environment says not to write them; else every process the tests start compiles the app again
# (0.5 s of the 5 s of CPU a process spends importing it).
test: setup lint
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The GPU checks alone (docs/gpu-checks.md). On a GPU machine set up with `make setup DEVICE=cuda`
# (or DEVICE=cuda here, for a fresh clone). Without a usable GPU every check skips with its reason and
# this exits 0. GPU_REPORT=PATH moves the JSON report; GPU_TEST_ARGS adds pytest arguments (-k NAME, -x).
GPU_TEST_ARGS ?=
test-gpu: setup
	$(PY) -m pytest -m gpu tests/gpu -rs $(GPU_TEST_ARGS)

# One command for a short GPU allocation (python -m app.bench.gpu_report): make test-gpu's checks on 12 workers,
# their bench excluded, then the GPU bench at 4,096 and 16,384 rows per GPU, each part under its own deadline
# carved from GPU_BUDGET_S seconds, so that a hang costs one part. Every figure goes to GPU_REPORT_DIR (its
# summary.json says what ran, for how long, and how it ended); GPU_BENCH_ARGS adds bench arguments. Without a GPU
# it says so and exits 0.
GPU_BUDGET_S ?= 600
GPU_REPORT_DIR ?= runs/gpu-report
GPU_BENCH_ARGS ?=
gpu-report: setup
	$(PY) -m app.bench.gpu_report --budget_s $(GPU_BUDGET_S) --output_dir $(GPU_REPORT_DIR) --bench_args "$(GPU_BENCH_ARGS)"

lint: setup
	$(VENV)/bin/hadolint Dockerfile

# Extra arguments for python -m app.bench, e.g. BENCH_ARGS="--preset gaudi_medium --run.measured_steps 5".
# Then the quality guard (python -m app.bench.quality_guard): the demo's AUC with and without each lever;
# BENCH_QUALITY=0 skips it, QUALITY_ARGS passes it arguments.
BENCH_ARGS ?=
BENCH_QUALITY ?= 1
QUALITY_ARGS ?=
bench: setup
	$(PY) -m app.bench $(BENCH_ARGS)
	@if [ "$(BENCH_QUALITY)" = 1 ]; then $(MAKE) --no-print-directory sample PY=$(PY) && $(PY) -m app.bench.quality_guard $(QUALITY_ARGS); fi

bench-data: setup
	$(PY) data/bench_data.py

# The quality bench (docs/quality.md): a recipe and a hashed logistic regression trained on the same rows, scored
# on the same validation rows; by default the demo recipe on the bundled sample. QUALITY_BENCH_ARGS passes it
# arguments, e.g. QUALITY_BENCH_ARGS="--recipe configs/demo_dcn.yaml --epochs 3 --output runs/quality.jsonl".
QUALITY_BENCH_ARGS ?=
bench-quality: setup sample
	$(PY) -m app.quality $(QUALITY_BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-compat-oldest .venv-compat-cudaimage .venv-compat-newest data/sample runs .pytest_cache

# ---- the oldest, the CUDA image's and the newest supported torch / fbgemm-gpu / torchrec (docs/gpus.md)
# Each stack gets its own environment, .venv-compat-<name> for requirements-compat-<name>.txt: its torch (with its
# dependencies), then requirements.txt without the lines the stack's file replaces, then the stack's
# own pins with --no-deps, as in `setup`. PyPI's Linux torch wheels are CUDA builds that also run on
# CPU (they bring ~5 GB of nvidia-* libraries); where PyTorch's CPU index is reachable, use it instead:
#   make test-compat COMPAT_TORCH_INDEX=https://download.pytorch.org/whl/cpu
COMPAT_TORCH_INDEX ?=
# The multi-process tests that matter on another stack: sharded fit, sharded == unsharded, resume,
# predict from a sharded checkpoint, the planner with the hardware presets; which optimizers run
# fused under that torch; and the speed levers' settings (compile, qcomms, fp16 tables, UVM caching).
COMPAT_TESTS := tests/distributed/test_sharding.py tests/checkpoint/test_resume.py \
	tests/distributed/test_topology.py tests/cli/test_train.py::test_predict_writes_one_probability_per_row_in_order \
	tests/train/test_optimizers.py tests/model/test_compile.py tests/distributed/test_qcomms.py \
	tests/distributed/test_embedding_tables.py tests/train/test_pipeline_versions.py

.venv-compat-%/.installed: requirements-compat-%.txt requirements.txt requirements-dev.txt
	test -x .venv-compat-$*/bin/python || $(PYTHON) -m venv .venv-compat-$*
	.venv-compat-$*/bin/python -m pip install --quiet --upgrade pip==25.3
	.venv-compat-$*/bin/python -m pip install --quiet $(if $(COMPAT_TORCH_INDEX),--index-url $(COMPAT_TORCH_INDEX)) \
		$$(grep -E '^torch==' requirements-compat-$*.txt)
	sed -nE 's/^([A-Za-z0-9_.-]+)==.*/\1/p' requirements-compat-$*.txt > .venv-compat-$*/replaced.txt
	grep -viE "^($$(paste -sd'|' .venv-compat-$*/replaced.txt))==" requirements.txt > .venv-compat-$*/requirements-app.txt
	grep -E '^(pytest|iniconfig|pluggy|Pygments|pytest-timeout)==' requirements-dev.txt >> .venv-compat-$*/requirements-app.txt
	.venv-compat-$*/bin/python -m pip install --quiet --no-deps -r .venv-compat-$*/requirements-app.txt
	.venv-compat-$*/bin/python -m pip install --quiet --no-deps -r requirements-compat-$*.txt
	.venv-compat-$*/bin/python -c "import torch, fbgemm_gpu, torchrec, lightning; \
		from importlib.metadata import version as v; \
		print('$* stack ok: torch', torch.__version__, '| fbgemm-gpu-cpu', v('fbgemm-gpu-cpu'), '| torchrec', v('torchrec'))"
	touch $@

# One stack at a time: install it, run its tests, then the next. With COMPAT_DROP_ENVS=1 (what .ci/run sets:
# its clone is thrown away) each stack's environment is removed once its tests pass, so the disk holds one
# CUDA build of torch (~6 GB) at a time instead of three.
COMPAT_STACKS := oldest cudaimage newest
COMPAT_DROP_ENVS ?= 0
test-compat: $(addprefix test-compat-,$(COMPAT_STACKS))

$(addprefix test-compat-,$(COMPAT_STACKS)): test-compat-%: .venv-compat-%/.installed
	.venv-compat-$*/bin/python -m pytest -q $(COMPAT_TESTS)
	@if [ "$(COMPAT_DROP_ENVS)" = 1 ]; then echo "removing .venv-compat-$* (COMPAT_DROP_ENVS=1)"; rm -rf .venv-compat-$*; fi
