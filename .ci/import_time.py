"""CI, shipping: the import time of the installed attnx (called by .ci/ship, in the wheel's venv).

Best of 7 runs of `python -X importtime`, for numpy alone and for attnx.
"""
import subprocess
import sys


def importtime(statement):
    """{module: cumulative us} of one `python -X importtime -c statement`."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", statement],
                         capture_output=True, text=True, check=True).stderr
    times = {}
    for line in err.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) == 3 and fields[1].isdigit():
            times[fields[2]] = int(fields[1])
    return times


# Best of 7 each. attnx's own part comes from the same runs as its total (numpy is imported
# inside `import attnx`), so a busy machine cannot make it negative.
numpy_alone = min(importtime("import numpy")["numpy"] for _ in range(7))
runs = [importtime("import attnx") for _ in range(7)]
total = min(r["attnx"] for r in runs)
own = min(r["attnx"] - r["numpy"] for r in runs)
print(f"import time (best of 7, -X importtime): numpy alone {numpy_alone / 1000:.1f} ms; "
      f"import attnx {total / 1000:.1f} ms in all, of which attnx's own {own / 1000:.1f} ms")
