"""Let the trunk's process reuse the memory its steps free, instead of faulting it in anew.

Each trunk step allocates its activations, gradients and temporaries and frees them at
the end. glibc's malloc serves blocks above a (moving) threshold with fresh ``mmap``
pages and gives memory at the top of its heaps back to the kernel once more than a trim
threshold is free, so every step touched fresh pages: 100-260 page faults a step for the
default job's SmallCNN trunk (batch 32, ~9 ms a step on a 2-core host). With the
thresholds raised the freed blocks are reused: 0-5 page faults a step, the step 3% shorter
alone and the trunk's time in a round 5% shorter
(``benchmarks/results/2026-12-default-experiment.md``). The cost is memory the process
may keep after a peak (at most the trim threshold free at the top of each heap); the
default job's ServerApp peaked at the same 651 MB either way.
"""

from __future__ import annotations

import ctypes

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

#: Blocks up to this size come from the heaps (glibc's largest allowed on 64 bits).
MMAP_THRESHOLD_BYTES = 32 << 20
#: Free memory a heap keeps at its top before giving it back.
TRIM_THRESHOLD_BYTES = 128 << 20


def reuse_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no glibc.

    Process-wide and for the rest of its life: call it in a process that trains a trunk.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows)
        return False
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
