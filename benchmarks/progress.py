"""A progress bar with an estimate of the time left, on stderr.

Uses tqdm when it is installed (``pip install .[bench]`` or ``pip install tqdm``); without it, a
line every ``every_s`` seconds with the count done and the time left at the rate so far.
"""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional: the plain fallback below
    _tqdm = None


class Progress:
    def __init__(self, total: int, desc: str, unit: str = "block", every_s: float = 15.0, enabled: bool = True):
        self.total, self.desc, self.unit, self.every_s = total, desc, unit, every_s
        self.done, self.start, self.last = 0, time.monotonic(), time.monotonic()
        self.enabled = enabled
        self.bar = (_tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, mininterval=1.0, leave=True,
                          dynamic_ncols=True) if enabled and _tqdm is not None else None)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every_s or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            left = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"{self.desc}: {self.done}/{self.total} {self.unit}s, {now - self.start:.0f} s so far, "
                  f"about {left:.0f} s left", file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        """Print a line without breaking the bar."""
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
