"""``python -m app``: the training application's entry point (``export`` writes an unsharded model file)."""

import atexit
import gc
import sys

if __name__ == "__main__":
    # Registered first, so it runs after every other exit handler: the interpreter's last garbage collection
    # would walk the ~400k objects that torch, Lightning and TorchRec made, only to free memory the process is
    # about to return (measured: 1.5 s of CPU of the 5.5 s a process that imports the app spends, every rank of
    # every command). Frozen, they are not walked; reference counting still frees the rest as before.
    atexit.register(gc.freeze)
    if sys.argv[1:2] == ["export"]:
        from app.checkpoint.export import main

        main(sys.argv[2:])
    else:
        from app.distributed.job_lifetime import follow_launcher

        follow_launcher()  # a rank of Lightning's launcher ends with it, from before the imports below
        from app.cli import cli_main

        cli_main()
