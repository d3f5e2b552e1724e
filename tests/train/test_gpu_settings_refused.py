"""GPU-only speed settings asked for where they cannot run are refused before any worker starts, in one
line naming the setting and the alternative: a GPU-only pipeline or CUDA-graph capture on CPU through
``python -m app fit``, and bf16 on a GPU without bf16 (torch's autocast would silently train in float32)."""

from __future__ import annotations

import pytest

from app.cli import cli_main
from app.train.precision import check_precision_supported


def exit_code(args: list[str]) -> int:
    """The exit code of ``python -m app ARGS`` (torchelastic's @record turns exit(0) into a return)."""
    try:
        cli_main(args)
    except SystemExit as exit_info:
        return exit_info.code
    return 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.pipeline", "fused_sparse_dist"], "model.pipeline = fused_sparse_dist needs GPUs: TorchRec's "
         "TrainPipelineFusedSparseDist does not run on cpu; use sparse_dist"),
        (["--model.compile", "true", "--model.compile_mode", "reduce-overhead"],
         "model.compile_mode = reduce-overhead replays the dense layers as CUDA graphs, which need a CUDA GPU (here: cpu)"),
    ],
)  # fmt: skip
def test_gpu_only_speed_settings_stop_fit_on_cpu_with_one_line(args, message, sample_dir, capsys):
    base = ["fit", "--config", "configs/demo.yaml", "--data.train", str(sample_dir / "train.tsv")]
    assert exit_code(base + ["--data.val", "null", "--data.test", "null", "--data.predict", "null", *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_bf16_is_refused_on_a_gpu_without_bf16_and_allowed_elsewhere():
    with pytest.raises(ValueError, match=r"trainer.precision = bf16-mixed: .* has no bf16 support \(torch.cuda.is_bf16_supported\(\) is False\); use 32-true"):
        check_precision_supported("bf16-mixed", "cuda", gpu_has_bf16=False)
    check_precision_supported("bf16-mixed", "cuda", gpu_has_bf16=True)
    check_precision_supported("32-true", "cuda", gpu_has_bf16=False)
    check_precision_supported("bf16-mixed", "cpu")  # emulated where the CPU lacks bf16 units: slower, not wrong
