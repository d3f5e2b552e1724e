"""A smaller pt2 package, loadable as before from Python and C++: what AOTInductor writes that no loader
reads is left out, and a small package's records are compressed.

AOTInductor's archive holds, beside the compiled library (``*.so``, the tables inside it as constants)
and its metadata, the generated C++ sources (``*.cpp``: about 100 KB), which a loader compiles only when
the archive has no library; and the library keeps its symbol tables for a debugger (about 80 KB).
``torch::inductor::AOTIModelPackageLoader`` (behind ``torch._inductor.aoti_load_package`` too) extracts
the records it needs with miniz, which inflates deflated records as it extracts them.

So the package is rewritten without the sources, the library stripped of what its loading does not use
(``strip --strip-unneeded`` keeps the dynamic symbols ``dlopen`` resolves), and, where the library is
under :data:`DEFLATE_BELOW_BYTES`, every record deflated: the compiled code shrinks to a third there,
where it is most of the file; float tables hardly compress (7 % of 166 MB of normally drawn values, at
about 14 s to compress on 2 cores), so a large package stays stored, as AOTInductor writes it.

``python -m app.checkpoint.package_size --float32 model.pt2 --int8 model-int8.pt2`` says where a package's
bytes go (each record stored and whole; the library's code and constants, each deflated alone; the constants
by what they are, from the contract) and the INT8 package's two ratios to the float32 one: the whole file,
and the tables alone (docs/serving.md).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import tempfile
import zipfile
import zlib
from pathlib import Path

from app.checkpoint.serving_runtime import contract_path
from app.command import run_command

DEFLATE_BELOW_BYTES = 32 * 2**20
_UNREAD_SUFFIXES = (".cpp",)  # compiled only by a loader that finds no library in the archive


def slim_package(package: Path) -> None:
    """Rewrites ``package`` in place: without the C++ sources, its libraries stripped, small ones deflated."""
    with zipfile.ZipFile(package) as source:
        records = [r for r in source.infolist() if not r.filename.endswith(_UNREAD_SUFFIXES)]
        if not any(r.filename.endswith(".so") for r in records):
            return  # a package of sources only (compiled where it is loaded): left as it is
        library_bytes = sum(r.file_size for r in records if r.filename.endswith(".so"))
        method = zipfile.ZIP_DEFLATED if library_bytes < DEFLATE_BELOW_BYTES else zipfile.ZIP_STORED
        slimmer = package.with_name(package.name + ".slim")
        with tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(slimmer, "w", method, compresslevel=6) as target:
            for record in records:
                if record.filename.endswith(".so"):
                    library = Path(source.extract(record, scratch))
                    _strip(library)
                    target.write(library, record.filename)
                    continue
                with source.open(record) as data, target.open(record.filename, "w", force_zip64=record.file_size > 2**31) as out:
                    shutil.copyfileobj(data, out, 1 << 22)
    slimmer.replace(package)


def _strip(library: Path) -> None:
    """Drops the symbol tables and debugging sections a loader does not read (where binutils' strip exists:
    it comes with the compiler AOTInductor needs)."""
    strip = shutil.which("strip")
    if strip is not None:
        subprocess.run([strip, "--strip-unneeded", str(library)], check=True, capture_output=True)


# The ELF section where AOTInductor's x86-64 libraries keep their constants (the weights, as one blob).
_CONSTANTS_SECTION = b".lrodata"


def library_parts(library: bytes) -> dict[str, bytes]:
    """A compiled library's code (everything but the constants) and constants, by its ELF section headers;
    all of it as code where it has no constants section (or is not a 64-bit little-endian ELF file)."""
    if library[:6] != b"\x7fELF\x02\x01":
        return {"code": library, "constants": b""}
    section_headers, = struct.unpack_from("<Q", library, 0x28)
    entry_bytes, count, names_index = struct.unpack_from("<HHH", library, 0x3A)
    def header(j: int) -> tuple[int, int, int]:  # (name offset, file offset, size)
        fields = struct.unpack_from("<IIQQQQ", library, section_headers + j * entry_bytes)
        return fields[0], fields[4], fields[5]
    names_offset = header(names_index)[1]
    for j in range(count):
        name, offset, size = header(j)
        if library[names_offset + name : names_offset + name + len(_CONSTANTS_SECTION) + 1] == _CONSTANTS_SECTION + b"\0":
            return {"code": library[:offset] + library[offset + size :], "constants": library[offset : offset + size]}
    return {"code": library, "constants": b""}


def package_bytes(package: Path) -> dict[str, object]:
    """Where a package's bytes go: its records (stored and whole), its library's code and constants (whole and
    each deflated alone) and, from its contract, what the constants are."""
    with zipfile.ZipFile(package) as archive:
        records = {r.filename.split("/")[-1]: {"stored": r.compress_size, "bytes": r.file_size} for r in archive.infolist()}
        libraries = [archive.read(r) for r in archive.infolist() if r.filename.endswith(".so")]
    split = [library_parts(library) for library in libraries]
    parts = {name: sum(len(part[name]) for part in split) for name in ("code", "constants")}
    deflated = {name: sum(len(zlib.compress(part[name], 6)) for part in split) for name in parts}
    contract = json.loads(contract_path(package).read_text()) if contract_path(package).is_file() else {}
    return {"file": package.stat().st_size, "records": records, "library": parts, "library_deflated": deflated,
            "constants": contract.get("constant_bytes", {})}  # fmt: skip


def report_package_sizes(float32: str, int8: str) -> dict[str, object]:
    """Where the bytes of a float32 pt2 package and its INT8 export go, and the INT8 file's size over the float32
    one's: the whole file, and the tables alone (from the packages' contracts).

    Args:
        float32: the package of ``python -m app export --format pt2``.
        int8: the package of ``python -m app export --format pt2 --quantize int8`` of the same model.
    """
    sizes = {}
    for kind, path in (("float32", Path(float32)), ("int8", Path(int8))):
        if not path.is_file():
            raise FileNotFoundError(f"{kind} = {path}: no such package")
        sizes[kind] = measured = package_bytes(path)
        print(f"{kind} {path}: {measured['file']:,} bytes")
        for name, record in measured["records"].items():
            if record["bytes"] > 1024:
                print(f"  record {name}: {record['stored']:,} stored, {record['bytes']:,} whole")
        for name in ("code", "constants"):
            print(f"  library {name}: {measured['library'][name]:,} bytes, {measured['library_deflated'][name]:,} deflated alone")
        print("  constants: " + ", ".join(f"{k} {v:,}" for k, v in measured["constants"].items()))
    tables = [sizes[kind]["constants"].get("tables") for kind in ("float32", "int8")]
    ratios = {"file": sizes["int8"]["file"] / sizes["float32"]["file"]}
    if all(tables):
        ratios["tables"] = tables[1] / tables[0]
    print("int8 / float32: " + ", ".join(f"{k} {v:.4f}" for k, v in ratios.items()))
    return {"packages": sizes, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    """``python -m app.checkpoint.package_size --float32 model.pt2 --int8 model-int8.pt2`` (``--help``)."""
    status = run_command(report_package_sizes, "python -m app.checkpoint.package_size", argv)
    if status:
        raise SystemExit(status)


if __name__ == "__main__":
    main()
