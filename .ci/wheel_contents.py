"""CI, shipping: what the wheel holds, and its size (called by .ci/ship).

    python .ci/wheel_contents.py SDIST RAW_WHEEL REPAIRED_WHEEL

The repaired wheel must hold one extension module, the typing files, the module of hooks the
tests import (attnx/_testing.py) and the OpenMP runtime; the wheel as built (before auditwheel)
must stay under 1.5 MiB.
"""
import os
import sys
import zipfile

sdist, raw, repaired = sys.argv[1:]
with zipfile.ZipFile(repaired) as z:
    infos = z.infolist()
names = [i.filename for i in infos]
extensions = [n for n in names if n.startswith("attnx/_core.") and n.endswith((".so", ".pyd"))]
assert len(extensions) == 1, f"expected one extension module, found {extensions}"
for needed in ("attnx/py.typed", "attnx/_core.pyi", "attnx/__init__.py", "attnx/reference.py",
               "attnx/_testing.py"):
    assert needed in names, f"{needed} is not in the wheel"
bundled = [i for i in infos if i.filename.startswith("attnx.libs/") and not i.is_dir()]
assert any("gomp" in i.filename or "omp" in i.filename for i in bundled), (
    f"no OpenMP runtime bundled: {[i.filename for i in bundled]}")


def kib(n):
    return f"{n / 1024:.0f} KiB"


raw_size, repaired_size = os.path.getsize(raw), os.path.getsize(repaired)
print(f"sdist:                {os.path.basename(sdist)}  {kib(os.path.getsize(sdist))}")
print(f"wheel (repaired):     {os.path.basename(repaired)}  {kib(repaired_size)}")
print(f"  without the OpenMP runtime (as built, before auditwheel): {kib(raw_size)}")
print(f"  bundled: " + ", ".join(f"{i.filename} ({kib(i.file_size)}, {kib(i.compress_size)} zipped)"
                                 for i in bundled))
print(f"  extension {extensions[0]}: {kib(next(i.file_size for i in infos if i.filename == extensions[0]))} unzipped")
assert raw_size < 1536 * 1024, f"the wheel without the OpenMP runtime is {kib(raw_size)} (target: < 1.5 MiB)"
