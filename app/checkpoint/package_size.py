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
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

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
