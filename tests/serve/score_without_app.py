"""Run as a script: scores rows with a pt2 package (and an exported program) in a process where importing
``app``, ``torchrec`` or ``fbgemm_gpu`` fails, as on a server that has torch alone.

    python score_without_app.py RUNTIME_PY PACKAGE_PT2 ROWS_TSV OUT_PT [PROGRAM_PT2 ...]

Saves to OUT_PT: the package's probabilities of ROWS (one batch), of the same rows in batches of 1 and 7
and tiled to 4,096 rows, each exported program's probabilities (by file stem), and the blocked modules
found loaded.
"""

import importlib.abc
import importlib.util
import sys

BLOCKED = ("app", "torchrec", "fbgemm_gpu")


class RefuseServerAbsentModules(importlib.abc.MetaPathFinder):
    """Makes ``import app`` (and torchrec, fbgemm_gpu, and their submodules) raise ImportError."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on this server")
        return None


sys.meta_path.insert(0, RefuseServerAbsentModules())

import torch  # noqa: E402  (after the finder: nothing torch imports may reach the blocked modules)


def load_runtime(path: str):
    spec = importlib.util.spec_from_file_location("serving_runtime", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(runtime_py: str, package_pt2: str, rows_tsv: str, out_pt: str, *programs_pt2: str) -> None:
    for name in BLOCKED:
        try:
            __import__(name)
        except ImportError:
            continue
        raise SystemExit(f"{name} imported although blocked")
    runtime = load_runtime(runtime_py)
    dense, ids, _ = runtime.read_tsv_rows(rows_tsv)
    package = runtime.ServingPackage(package_pt2)
    whole = package.score(dense, ids)
    in_ones = torch.cat([package.score(dense[i : i + 1], ids[i : i + 1]) for i in range(dense.shape[0])])
    in_sevens = torch.cat([package.score(dense[i : i + 7], ids[i : i + 7]) for i in range(0, dense.shape[0], 7)])
    repeats = -(-4096 // dense.shape[0])
    tiled = package.score(dense.repeat(repeats, 1)[:4096], ids.repeat(repeats, 1)[:4096])
    by_program = {}
    for path in programs_pt2:
        program = torch.export.load(path).module()
        with torch.no_grad():
            by_program[path.rsplit("/", 1)[-1].removesuffix(".pt2")] = program(dense, ids)
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    torch.save({"whole": whole, "ones": in_ones, "sevens": in_sevens, "tiled": tiled, "program": by_program,
                "loaded": loaded}, out_pt)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
