"""trainer.strategy.init_args.qcomms: which precisions each backend gets, and the codecs it gives the sharders.

The 2-process training run with fp16 communication (losses against uncompressed, codecs on the sharded
module) is in tests/train/test_pipeline.py, beside the uncompressed run it compares with.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from app.distributed.qcomms import QCommsSettings, check_qcomms, sharders_with_qcomms
from tests.cli.test_cli import test_bad_settings_stop_before_any_worker_with_one_line as refused_before_launch


@pytest.mark.parametrize(("settings", "device_type", "message"), [
    (QCommsSettings("bf16", "fp16"), "cpu", "qcomms.forward_precision = bf16: not available on cpu (gloo carries fp32, fp16)"),
    (QCommsSettings("fp16", "bf16"), "cpu", "qcomms.backward_precision = bf16: not available on cpu"),
    (QCommsSettings("fp8", "fp32"), "cpu", "qcomms.forward_precision = fp8: not available on cpu"),
    (QCommsSettings("fp16", "fp8"), "cuda", "qcomms.backward_precision = fp8: TorchRec quantizes gradients to fp16 or bf16 only"),
    (QCommsSettings("int4", "fp16"), "cuda", "qcomms.forward_precision = 'int4': choose one of fp32, fp16, bf16, fp8"),
    (QCommsSettings("fp16", "fp16", forward_loss_scale=0.0), "cuda", "qcomms.forward_loss_scale = 0.0: must be > 0"),
])  # fmt: skip
def test_precisions_a_backend_cannot_carry_are_refused_by_name(settings, device_type, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_qcomms(settings, device_type)


@pytest.mark.parametrize(("settings", "device_type"), [
    (None, "cpu"), (QCommsSettings("fp16", "fp16"), "cpu"), (QCommsSettings("fp32", "fp16"), "cpu"),
    (QCommsSettings("bf16", "bf16"), "cuda"), (QCommsSettings("fp8", "bf16"), "cuda"),
])  # fmt: skip
def test_precisions_a_backend_carries_are_accepted(settings, device_type):
    check_qcomms(settings, device_type)


def test_the_sharders_get_fp16_codecs_for_the_pooled_all_to_all_and_none_when_off():
    (sharder,) = sharders_with_qcomms(QCommsSettings("fp16", "fp16"), torch.device("cpu"))
    assert isinstance(sharder, EmbeddingBagCollectionSharder)
    codecs = sharder.qcomm_codecs_registry["POOLED_EMBEDDINGS_ALL_TO_ALL"]
    assert codecs.forward.quantized_dtype == torch.float16 and codecs.backward.quantized_dtype == torch.float16
    for off in (None, QCommsSettings()):  # fp32 both ways: TorchRec builds no codecs
        (plain,) = sharders_with_qcomms(off, torch.device("cpu"))
        assert plain.qcomm_codecs_registry is None


def test_the_cli_refuses_bf16_communication_on_cpu_before_any_worker(sample_dir, capsys):
    refused_before_launch(
        ["--trainer.strategy.init_args.qcomms", "{forward_precision: bf16, backward_precision: bf16}"],
        "qcomms.forward_precision = bf16: not available on cpu", sample_dir, capsys,
    )
