"""``python -m app.bench``: see :mod:`app.bench.cli`."""

from app.bench.cli import main

if __name__ == "__main__":
    main()
