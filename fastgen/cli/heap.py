"""Keep glibc's malloc from returning the decoder step's big buffers to the OS after every step.

Why: a CPU decode step allocates and frees a few ``rows x vocabulary`` float32 buffers (the LM head's
output, the bias added to it, the log-softmax): 13 MB each for 64 rows of a 50k vocabulary. glibc
hands the top of its heap back to the OS whenever more than its trim threshold is free there, and
that threshold follows the largest block freed so far (2 x, at most 64 MB), so a step that frees
two or three such buffers together gives their pages back and the next step faults them in again,
zero-filled. Measured on a small BART (d=384, 64 rows, 1 thread): 8.8k minor page faults per
continuous-batching step and about 20 % of its CPU time (static batches 2.6k per step and 10 %);
with the thresholds below, none, and the two loops' steps cost the same.

The CLI owns its process, so it sets two thresholds once at start-up (``mallopt``): blocks up to
32 MB (glibc's ceiling for this setting) come from the heap instead of fresh ``mmap`` s, and up to
:data:`TRIM_BYTES` of free memory may stay at the top of the heap. The opt-in fast modes
(``fast_gemm``, ``int8``) set the same thresholds the first time one runs in a process: bart-base's
encoder alone refaulted ~45k pages per ``generate`` call (its 1024 x 3072 buffers), 0.36 -> 0.29 s
of an int8 call with one new token, one core. Nothing changes where the C library is not glibc,
or where the user tunes malloc already (``MALLOC_*`` or ``GLIBC_TUNABLES`` in the environment), or
with ``FASTGEN_HEAP=default``. The default (exact) mode and ``generate_many`` leave the process's
allocator alone; a program can set the same thresholds with
``MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=268435456``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger("fastgen.cli")

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_BYTES = 32 << 20
TRIM_BYTES = 256 << 20
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def why_not(environ: dict[str, str] | None = None) -> str | None:
    """Why the thresholds stay as they are (None: they may be set)."""
    environ = os.environ if environ is None else environ
    if environ.get("FASTGEN_HEAP", "").lower() == "default":
        return "FASTGEN_HEAP=default"
    if any(name in environ for name in _USER_SETTINGS):
        return "malloc is tuned in the environment"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library is not glibc"
    return None


def keep_freed_memory() -> bool:
    """Set the thresholds (see the module docs); whether they were set."""
    reason = why_not()
    if reason is not None:
        logger.debug("malloc thresholds left as they are: %s", reason)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    except (OSError, AttributeError) as exc:  # no libc to load, or one without mallopt
        logger.debug("malloc thresholds left as they are: %s", exc)
        return False
    return done
