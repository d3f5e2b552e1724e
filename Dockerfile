# syntax=docker/dockerfile:1
#
# DLRM trainer (PyTorch Lightning + TorchRec). AMD Instinct (ROCm) first, NVIDIA (CUDA) by build arg.
#
#   ROCm (default):  docker build -t dlrm:rocm .
#   CUDA:            docker build --build-arg TARGET=cuda -t dlrm:cuda .
#
# Needs BuildKit (the default builder since Docker 23): it builds only the stage that TARGET selects.
# Run flags, multi-GPU and what was (not) verified: docs/docker.md.

# rocm | cuda
ARG TARGET=rocm

# ROCm base: AMD's training image, which brings its own ROCm builds of torch, fbgemm_gpu and torchrec.
# The tag is pinned, but a tag can be re-pushed: for reproducible builds pin the digest as well, e.g.
#   --build-arg ROCM_BASE_IMAGE=rocm/primus:v26.1@sha256:<digest>
# (get it with `docker buildx imagetools inspect rocm/primus:v26.1`).
# AMD documents v26.1 as ROCm 7.1.0, Python 3.10, torch 2.10.0.dev20251112+rocm7.1. That is NOT the
# torch 2.13 / fbgemm 1.8 / torchrec 1.8 set that requirements.txt pins: on this path the image's own
# builds are used as they are. Which torchrec and fbgemm_gpu versions v26.1 ships could not be
# confirmed without pulling it; the import check below prints them.
ARG ROCM_BASE_IMAGE=rocm/primus:v26.1

# CUDA base: the official PyTorch image. The PyPI wheel of fbgemm-gpu 1.8.0 is a CUDA 13 build (it links
# libcudart.so.13), so this must be a CUDA 13.x image of torch 2.13.0. Pin its digest too.
ARG CUDA_BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime


# ---------------------------------------------------------------------------------------------------
# ROCm: keep the image's torch / fbgemm_gpu / torchrec; add only what it lacks.
FROM ${ROCM_BASE_IMAGE} AS base-rocm

# What the ROCm image lacks. Each entry MUST be a line of requirements.txt: the RUN below fails the
# build if one is not, so the two cannot drift apart. Deliberately absent: torch, fbgemm-gpu(-cpu),
# torchrec (the image's ROCm builds stay), numpy (the image's build is the one its torch and fbgemm
# were built against; numpy 2.4.6 also needs Python >= 3.11) and tensordict (0.15.3 needs torch >= 2.11).
ARG ROCM_APP_PINS="lightning==2.6.6 torchmetrics==1.9.0 jsonargparse[signatures]==4.53.0 tensorboard==2.21.0"
# A pure-Python runtime dependency of torchrec, installed only if the image does not have it.
ARG ROCM_TORCHREC_DEP_PIN="pyre-extensions==0.0.32"
# torchrec 1.5-1.7 import iopath at the top of torchrec/datasets/criteo.py, which the app imports;
# installed only if the image's torchrec cannot import it.
ARG ROCM_IOPATH_PINS="iopath==0.1.9 portalocker==4.4.2"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace
COPY requirements.txt ./

# 1. Check the inline pins against requirements.txt.
# 2. Record the image's GPU stack and hand it to pip as constraints, so that no dependency of the
#    packages below can replace it.
# 3. Install, then fail if the GPU stack changed after all.
# pip then reports "dependency conflicts" for torchrec (its wheel declares fbgemm-gpu and
# torchmetrics==1.0.3): expected, the same reason the Makefile installs torchrec with --no-deps.
RUN set -euf; \
    for pin in ${ROCM_APP_PINS} ${ROCM_TORCHREC_DEP_PIN} ${ROCM_IOPATH_PINS}; do \
        grep -qxF "${pin}" requirements.txt \
            || { echo "Dockerfile pin '${pin}' is not a line of requirements.txt" >&2; exit 1; }; \
    done; \
    stack='^(torch|torchvision|torchaudio|triton|pytorch[-_]triton[-_]rocm|fbgemm[-_]gpu[-_a-z0-9]*|torchrec[-_a-z0-9]*|numpy)=='; \
    python3 -m pip list --format=freeze | grep -iE "${stack}" | sort > /tmp/image-stack.txt; \
    echo "GPU stack of the base image (kept as is):"; cat /tmp/image-stack.txt; \
    python3 -m pip install --no-cache-dir -c /tmp/image-stack.txt ${ROCM_APP_PINS}; \
    python3 -c "import pyre_extensions" 2>/dev/null \
        || python3 -m pip install --no-cache-dir -c /tmp/image-stack.txt "${ROCM_TORCHREC_DEP_PIN}"; \
    python3 -c "import iopath" 2>/dev/null \
        || python3 -m pip install --no-cache-dir -c /tmp/image-stack.txt ${ROCM_IOPATH_PINS}; \
    python3 -m pip list --format=freeze | grep -iE "${stack}" | sort | diff -u /tmp/image-stack.txt - \
        || { echo "pip changed the image's torch/fbgemm/torchrec stack" >&2; exit 1; }; \
    rm /tmp/image-stack.txt


# ---------------------------------------------------------------------------------------------------
# CUDA: the image has torch 2.13.0 but no fbgemm-gpu / torchrec; install the pinned set.
FROM ${CUDA_BASE_IMAGE} AS base-cuda

# The RUN below installs the CUDA build fbgemm-gpu==1.8.0 (requirements.txt pins the CPU build,
# fbgemm-gpu-cpu==1.8.0, instead), from PyPI (a CUDA 13 build) unless FBGEMM_GPU_INDEX_URL is set.
# With a CUDA 12.x base image (torch 2.13.0+cu12x) set it to the matching PyTorch wheel index,
# e.g. --build-arg FBGEMM_GPU_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG FBGEMM_GPU_INDEX_URL=""

# The official PyTorch images install into the system Python, which is marked externally managed
# (PEP 668); this lets pip install into it.
ENV PIP_BREAK_SYSTEM_PACKAGES=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace
COPY requirements.txt requirements-torchrec.txt ./

# Same order as the Makefile's `setup`: torch is already there (and constrained to the image's build),
# then requirements.txt without torch and the CPU fbgemm, then the CUDA fbgemm-gpu, then torchrec with
# --no-deps (its wheel declares fbgemm-gpu unpinned and torchmetrics==1.0.3).
# numpy==2.4.6 in requirements.txt needs Python >= 3.11.
RUN set -euf; \
    python3 -c "import sys, torch; v = torch.__version__.split('+')[0]; \
sys.exit(0 if v == '2.13.0' else f'base image has torch {torch.__version__}; fbgemm-gpu 1.8 / torchrec 1.8 need 2.13.0')"; \
    python3 -m pip list --format=freeze | grep -iE '^(torch|triton)==' | sort > /tmp/image-stack.txt; \
    echo "torch of the base image (kept as is):"; cat /tmp/image-stack.txt; \
    grep -vE '^(torch|fbgemm-gpu-cpu)==' requirements.txt > /tmp/requirements-cuda.txt; \
    python3 -m pip install --no-cache-dir -c /tmp/image-stack.txt -r /tmp/requirements-cuda.txt; \
    ( [ -z "${FBGEMM_GPU_INDEX_URL}" ] || export PIP_INDEX_URL="${FBGEMM_GPU_INDEX_URL}"; \
      python3 -m pip install --no-cache-dir --no-deps fbgemm-gpu==1.8.0 ); \
    python3 -m pip install --no-cache-dir --no-deps -r requirements-torchrec.txt; \
    python3 -m pip list --format=freeze | grep -iE '^(torch|triton)==' | sort | diff -u /tmp/image-stack.txt - \
        || { echo "pip changed the image's torch" >&2; exit 1; }; \
    rm /tmp/image-stack.txt /tmp/requirements-cuda.txt


# ---------------------------------------------------------------------------------------------------
# base-${TARGET} is one of the two stages above, not a registry image, so DL3006 (untagged image) does
# not apply; hadolint cannot resolve the variable to see that.
# hadolint ignore=DL3006
FROM base-${TARGET} AS final
ARG TARGET

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace

# ENTRYPOINT runs `python`; some images only have `python3`.
RUN command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python

# Build-time import check of the stack (before the code is copied, so it stays cached). There is no GPU
# during `docker build`: it checks that torch is a HIP (rocm) or CUDA (cuda) build, not that a device
# is usable. The CUDA fbgemm_gpu library links libnvidia-ml.so.1, which belongs to the NVIDIA driver
# and only appears in a container started with `--gpus`; if that is the only reason fbgemm_gpu /
# torchrec cannot be imported here, the check says so and defers to the run-time check in
# docs/docker.md. Any other failure fails the build.
RUN TARGET="${TARGET}" python - <<'PY'
import os, sys
import torch, lightning, torchmetrics, jsonargparse

target = os.environ["TARGET"]
print(f"python {sys.version.split()[0]} | torch {torch.__version__} | HIP {torch.version.hip} "
      f"| CUDA {torch.version.cuda} | lightning {lightning.__version__} "
      f"| torchmetrics {torchmetrics.__version__} | jsonargparse {jsonargparse.__version__}")
print(f"torch sees a GPU now: {torch.cuda.is_available()} (expected False: no GPU during docker build)")
if target == "rocm" and not torch.version.hip:
    sys.exit("TARGET=rocm but torch is not a ROCm (HIP) build")
if target == "cuda" and not torch.version.cuda:
    sys.exit("TARGET=cuda but torch is not a CUDA build")
try:
    import fbgemm_gpu, torchrec
except Exception as err:  # noqa: BLE001 - reported and re-raised below unless it is the driver library
    if target == "cuda" and "libnvidia-ml.so.1" in str(err):
        print("fbgemm_gpu needs the NVIDIA driver's libnvidia-ml.so.1, absent during docker build; "
              "import deferred to run time (docs/docker.md)")
    else:
        raise
else:
    print(f"fbgemm_gpu {getattr(fbgemm_gpu, '__version__', '?')} "
          f"({getattr(fbgemm_gpu, '__variant__', '?')}) | torchrec {getattr(torchrec, '__version__', '?')}")
PY

COPY . .

ENTRYPOINT ["python", "-m", "app"]
CMD ["fit", "--config", "configs/demo.yaml"]
