"""``python -m app``: the training application's entry point (``export`` writes an unsharded model file)."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        from app.checkpoint.export import main

        main(sys.argv[2:])
    else:
        from app.distributed.job_lifetime import follow_launcher

        follow_launcher()  # a rank of Lightning's launcher ends with it, from before the imports below
        from app.cli import cli_main

        cli_main()
