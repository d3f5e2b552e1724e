"""``python -m app``: the training application's entry point (``export`` writes an unsharded model file)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from app.checkpoint.export import main

        main(sys.argv[2:])
    else:
        from app.cli import cli_main

        cli_main()
