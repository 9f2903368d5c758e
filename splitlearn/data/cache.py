"""A device's training data kept between rounds: on its own disk, or in a warm process.

On Flower's Deployment Engine every message starts a fresh ClientApp process, so
loading a partition pays the loaders' imports and the partitioning every round:
about 4 s for a digits partition on a 2-core host (scikit-learn's loader, Hugging
Face ``datasets`` and flwr-datasets), where a warm process takes 9 ms. A device
with a cache folder (node config ``cache-dir``; ``python -m clients.connect``
sets one) builds its data once and reads the tensors back afterwards.

A file is named by a digest of everything that decides the data: the loader's
arguments, the size and modification time of each local file it reads, and the
source of this package's data code, so a change to any of them builds afresh.
A file that cannot be read is rebuilt.

In Flower's Simulation Engine a warm process (a Ray worker) serves one simulated
device after another, and building a partition there still took part of a ClientApp's
set-up every round (flwr-datasets' shard, then the tensors): 3-7 ms for digits, 105-128
ms for a tenth of 10,000 MNIST digits. At the round's start and whenever a ClientApp
hands its slot to the next, that set-up leaves the shared trunk idle.
:data:`PROCESS_DATA` keeps the partitions a process built, up to
:data:`PROCESS_DATA_BYTES`, least recently used first out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

log = logging.getLogger(__name__)

#: The modules whose code decides what a partition holds.
_DATA_CODE = tuple(sorted(Path(__file__).parent.glob("*.py")))


def cached_dataset(folder: str | Path, key: Mapping[str, object],
                   build: Callable[[], TensorDataset]) -> TensorDataset:
    """Return the data ``key`` names from ``folder``, or ``build()`` it and keep it there.

    Parameters
    ----------
    folder : str or Path
        The device's cache folder (made if missing).
    key : Mapping[str, object]
        JSON-able description of the data (the loader's arguments). A ``path``
        entry naming local files adds their sizes and modification times.
    build : Callable[[], TensorDataset]
        Loads the data when no readable file holds it.
    """
    path = Path(folder) / f"data-{_digest(key)}.pt"
    try:
        images, labels = torch.load(path, weights_only=True)
        return TensorDataset(images, labels)
    except FileNotFoundError:
        pass
    except Exception as err:  # noqa: BLE001 - any unreadable file is rebuilt
        log.warning("data cache: %s unreadable (%s), rebuilding", path, err)
    data = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save(list(data.tensors), partial)
    os.replace(partial, path)  # a reader sees the whole file or none
    return data


def _digest(key: Mapping[str, object]) -> str:
    described = {"key": dict(key), "files": _file_stamps(key.get("path")),
                 "code": [hashlib.sha256(p.read_bytes()).hexdigest() for p in _DATA_CODE]}
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _file_stamps(path: object) -> list[tuple[str, int, int]]:
    """Size and modification time of each file under ``path`` (none if it is not local)."""
    if not isinstance(path, str | Path) or not Path(path).exists():
        return []
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]


#: The most a process keeps of the data of the devices it served (digits: 37 KB a
#: partition; a CIFAR-10 tenth: 61 MB).
PROCESS_DATA_BYTES = 256 * 2**20


class ProcessData:
    """Partitions a process has built, kept in memory between rounds (least recently used out).

    Parameters
    ----------
    max_bytes : int
        The most the kept tensors may hold; data larger than that is built every time.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._kept: OrderedDict[str, tuple[torch.Tensor, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Mapping[str, object], build: Callable[[], TensorDataset]
            ) -> TensorDataset:
        """Return the data ``key`` names: a copy of the kept tensors, or ``build()`` them.

        ``key`` must name everything that decides the data (the loader's arguments):
        within one process the same key is the same data.
        """
        name = json.dumps(dict(key), sort_keys=True, default=str)
        with self._lock:
            tensors = self._kept.get(name)
            if tensors is not None:
                self._kept.move_to_end(name)
        if tensors is None:
            data = build()
            tensors = tuple(data.tensors)
            if not self._keep(name, tensors):
                return data  # not kept: nobody else holds it, no copy needed
        # Copies: a round may change its batches' tensors, never the next round's data.
        return TensorDataset(*(t.clone() for t in tensors))

    def _keep(self, name: str, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Keep ``tensors`` under ``name`` within the bound; return whether they are kept."""
        size = sum(t.nbytes for t in tensors)
        if size > self.max_bytes:
            return False
        with self._lock:
            if name in self._kept:  # built meanwhile by another thread: keep theirs
                return False
            while self._kept and self.bytes + size > self.max_bytes:
                _, dropped = self._kept.popitem(last=False)
                self.bytes -= sum(t.nbytes for t in dropped)
            self._kept[name] = tensors
            self.bytes += size
        return True

    def __len__(self) -> int:
        return len(self._kept)


#: This process's kept partitions (used where a device has no cache folder).
PROCESS_DATA = ProcessData(PROCESS_DATA_BYTES)
