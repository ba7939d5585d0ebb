"""glibc's malloc tuned for CPU training: a step's large temporaries are reused, not re-faulted.

A training step on CPU allocates and frees the same large tensors every step: X-Pool's pooled
videos are (B, B, D), 32 MiB at B = 128, D = 512. With glibc's defaults a block over its dynamic
mmap threshold (at most 32 MiB) is a fresh ``mmap`` each time, and the freed top of the heap is
handed back once it exceeds the trim threshold; either way the next step touches new pages, and
the kernel faults in and zeroes every 4 KiB of them again. :func:`tune_allocator` raises both
thresholds so that blocks up to 256 MiB come from the heap and up to 1 GiB of freed heap stays
with the process for the next step (a glibc that refuses an mmap threshold above 32 MiB gets
32 MiB). Larger blocks (a store's arrays) are still mapped and returned to the system when freed.

Measured (``tvrpipe bench allocator``, and ``fit`` on the generated 9k store; docs/performance.md):
a step at D = 512 is 1.9-2.0x faster for tmass, 1.5x for xpool and 1.3-1.4x for duq; the GEMM-bound
uatvr, prota and seqtransf move within the run-to-run spread. The arithmetic is untouched, so
results are the same to the bit. The price is memory: the heap keeps what a step used between
steps, and a freed block in its middle serves only requests no larger than itself, so the peak
resident memory at D = 512 grows by up to 0.6 GB (tmass).

``fit`` (train-head) calls it. ``finetune`` does not: its CPU step through both CLIP towers is
GEMM-bound, gained nothing measurable, and its process held ~1 GB more with the tuning.

A user's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` (glibc's environment
variables) always win: with either set, nothing is changed. Elsewhere than glibc, nothing is
changed either.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20  # choice: blocks up to 256 MiB from the heap (a step's tensors at D = 512)
MMAP_THRESHOLD_CAPPED = 32 << 20  # where glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30  # choice: up to 1 GiB of freed heap kept for the next step
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h> parameter numbers

_state: str | None = None


def tune_allocator() -> str:
    """Raise glibc's mmap and trim thresholds for this process, once; returns what was done.

    Process-wide and idempotent: the first call decides, later calls return the same answer.
    """
    global _state
    if _state is None:
        _state = _tune()
        log.debug("allocator: %s", _state)
    return _state


def _tune() -> str:
    user = [v for v in USER_VARIABLES if v in os.environ]
    if user:
        return f"left as set by {', '.join(user)}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "left as is (not glibc)"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return "left as is (glibc's mallopt not found)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Some glibc versions refuse an mmap threshold above half their arena heap size (32 MiB on 64-bit):
    # there, 32 MiB still keeps every smaller block in the heap.
    mmap = next((v for v in (MMAP_THRESHOLD, MMAP_THRESHOLD_CAPPED) if mallopt(_M_MMAP_THRESHOLD, v)), None)
    trim = TRIM_THRESHOLD if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) else None
    if mmap is None or trim is None:
        refused = " and ".join(name for name, v in (("mmap", mmap), ("trim", trim)) if v is None)
        return f"glibc refused the {refused} threshold (left at its default)"
    return f"glibc: blocks up to {mmap >> 20} MiB from the heap, {trim >> 20} MiB of it kept"
