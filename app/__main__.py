"""``python -m app``: the training application's entry point."""

from app.cli import cli_main

if __name__ == "__main__":
    cli_main()
