"""``python -m app.bench.quality``: see :mod:`app.bench.quality.bench`."""

from app.bench.quality.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
