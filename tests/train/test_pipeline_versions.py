"""Which of TorchRec's pipelines ``model.pipeline`` offers depends on the installed TorchRec: a pipeline it
lacks is refused when the module is built (before any worker starts), naming the setting, the version
and the alternative. Run on every supported stack by ``make test-compat`` (torchrec 1.5 has no lite pipeline)."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from app.train.module import DLRMModule
from app.train.pipeline import PIPELINE_CLASSES, check_pipeline, pipeline_class

# The first TorchRec release of each pipeline class the setting names (read in each release's
# torchrec/distributed/train_pipeline/train_pipelines.py).
FIRST_RELEASE = {"sparse_dist": (1, 5), "semi_sync": (1, 5), "fused_sparse_dist": (1, 5), "sparse_dist_lite": (1, 6)}


def torchrec_release() -> tuple[int, int]:
    major, minor = version("torchrec").split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("name", sorted(PIPELINE_CLASSES))
def test_a_pipeline_is_offered_exactly_where_the_installed_torchrec_has_it(name):
    if torchrec_release() >= FIRST_RELEASE[name]:
        check_pipeline(name)
        assert pipeline_class(name).__name__ == PIPELINE_CLASSES[name]
        return
    with pytest.raises(ValueError, match=f"model.pipeline = {name}: torchrec .* has no {PIPELINE_CLASSES[name]}; use sparse_dist or none"):
        DLRMModule(pipeline=name, num_embeddings_per_feature=10)
