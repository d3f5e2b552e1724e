"""``python -m app.quality``: see :mod:`app.quality.bench`."""

from app.quality.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
