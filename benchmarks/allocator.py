"""Page faults per trunk step with glibc's malloc as set by default and as the trunk sets it.

``python -m benchmarks allocator``: a fresh process takes steps of the default job's trunk
(SmallCNN at cut 1, batch 32), 40 as glibc's malloc is set by default and 40 after
:func:`server.allocator.reuse_freed_memory` (each after 10 to settle), and reports the
minor page faults a step took in each (measured 33-257 by default, 0-5 reusing). A
count of the kernel's, not a test: it moves with what else the machine is doing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence

FAULTS_PER_STEP = """
    import resource, torch
    from server.allocator import reuse_freed_memory
    from server.sessions.split import train_on_batch
    from server.trunk import Trunk
    from splitlearn.models import build_model
    torch.set_num_threads(1)
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10)
    trunk = Trunk(model, lr=0.05, momentum=0.5)
    with torch.no_grad():
        acts = model.stages[0](torch.rand(32, 1, 8, 8))
    labels = torch.randint(0, 10, (32,))
    def faults_per_step():
        for _ in range(10):
            train_on_batch(trunk, 1, acts.clone(), labels)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(40):
            train_on_batch(trunk, 1, acts.clone(), labels)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 40
    default = faults_per_step()
    assert reuse_freed_memory()
    print(default, faults_per_step())
"""


def faults_per_step() -> tuple[float, float]:
    """Return a fresh process's page faults per step: (glibc's default, reusing freed memory)."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(FAULTS_PER_STEP)],
                         capture_output=True, text=True, check=True)
    default, reusing = map(float, run.stdout.split()[-2:])
    return default, reusing


def bench_allocator(overrides: Sequence[str], *, repeats: int = 3) -> None:
    """Print the faults per step of ``repeats`` fresh processes, then a JSON line of them."""
    if overrides:
        raise ValueError(f"the allocator benchmark takes no overrides (got {list(overrides)})")
    rows = []
    for repeat in range(repeats):
        default, reusing = faults_per_step()
        rows.append({"default": default, "reusing": reusing})
        print(f"process {repeat + 1}: {default:.1f} page faults a step by default, "
              f"{reusing:.1f} reusing freed memory", flush=True)
    print(json.dumps({"faults_per_step": rows}))
