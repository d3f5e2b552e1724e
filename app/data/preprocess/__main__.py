"""``python -m app.data.preprocess``: see :mod:`app.data.preprocess.cli`."""

from app.data.preprocess.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
