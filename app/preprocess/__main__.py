"""``python -m app.preprocess``: see :mod:`app.preprocess.cli`."""

from app.preprocess.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
