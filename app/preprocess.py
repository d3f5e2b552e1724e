"""``python -m app.preprocess``: the former name of ``python -m app.data.preprocess``, kept so that
existing scripts keep working. The code lives in :mod:`app.data.preprocess`."""

from __future__ import annotations

from app.data.preprocess.cli import main


def __getattr__(name: str):
    raise AttributeError(f"app.preprocess is only the command's old name: import {name} from app.data.preprocess")


if __name__ == "__main__":
    raise SystemExit(main())
