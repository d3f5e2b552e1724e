"""Lightning's CSV and TensorBoard loggers with ``save_dir`` optional, so that configs need no path.

Lightning's loggers require ``save_dir`` when the command line is parsed, before the run's folder
(``trainer.default_root_dir``) is known; the CLI fills in the run's folder where it is left out.
"""

from __future__ import annotations

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger


class RunCSVLogger(CSVLogger):
    """Lightning's CSVLogger writing ``metrics.csv`` and ``hparams.yaml`` under ``save_dir/name/version_N``.

    Args:
        save_dir: parent folder of the logs (default: ``trainer.default_root_dir``).
        name: sub-folder of ``save_dir``.
        version: version number or name (default: the next free ``version_N``).
        flush_logs_every_n_steps: steps between writes of the metrics file.
    """

    def __init__(
        self, save_dir: str | None = None, name: str = "csv", version: int | str | None = None,
        flush_logs_every_n_steps: int = 100,
    ) -> None:  # fmt: skip
        if save_dir is None:
            raise ValueError("RunCSVLogger: save_dir is not set (the CLI sets it to trainer.default_root_dir)")
        super().__init__(save_dir, name=name, version=version, flush_logs_every_n_steps=flush_logs_every_n_steps)


class RunTensorBoardLogger(TensorBoardLogger):
    """Lightning's TensorBoardLogger writing events under ``save_dir/name/version_N``.

    Args:
        save_dir: parent folder of the logs (default: ``trainer.default_root_dir``).
        name: sub-folder of ``save_dir``.
        version: version number or name (default: the next free ``version_N``).
    """

    def __init__(self, save_dir: str | None = None, name: str = "tensorboard", version: int | str | None = None) -> None:
        if save_dir is None:
            raise ValueError("RunTensorBoardLogger: save_dir is not set (the CLI sets it to trainer.default_root_dir)")
        super().__init__(save_dir, name=name, version=version)
