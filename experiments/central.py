"""The limit a split run is measured against: the machine training the whole model itself.

The same network, batch size and optimiser as the run's config, trained centrally
on every core: one process per core, each with one intra-op thread (more threads
per process oversubscribe small CPUs; see benchmarks/results/2026-12-overhead.md),
data-parallel with PyTorch's ``DistributedDataParallel`` over gloo on 127.0.0.1.
Each process trains on its share of the training split (the union of the clients'
partitions); one pass over the split is an epoch, and samples/s is measured over
every epoch but the first (warm-up), as the split runs are measured over rounds 2+.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from omegaconf import DictConfig
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from splitlearn.config import to_object
from splitlearn.data import held_out_dataset, load_client_data
from splitlearn.evaluation import evaluate_model
from splitlearn.models.factory import build_model_from_config


@dataclass(frozen=True)
class CentralResult:
    """Throughput of central data-parallel training.

    Attributes
    ----------
    processes : int
        Processes (one per core).
    samples_per_s : float
        Training samples per second over the steady epochs, all processes together.
    epoch_s : list[float]
        Wall seconds of each epoch (the slowest process's).
    test_accuracy : float
        Accuracy on the held-out split after the last epoch.
    """

    processes: int
    samples_per_s: float
    epoch_s: list[float]
    test_accuracy: float


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _train(rank: int, cfg: DictConfig, world: int, port: int, epochs: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        dataset = to_object(cfg.dataset)
        # The union of the clients' partitions, dealt to the processes the same way.
        data = load_client_data(dataset=dataset.name, partition_id=rank, num_partitions=world,
                                partitioner="iid", seed=cfg.seed, path=dataset.path,
                                test_fraction=dataset.test_fraction,
                                image_size=dataset.image_size)
        model = build_model_from_config(to_object(cfg.model), dataset, seed=cfg.seed)
        net = DistributedDataParallel(model)
        s = cfg.strategy
        optimizer = torch.optim.SGD(net.parameters(), lr=s.lr, momentum=s.momentum,
                                    weight_decay=s.weight_decay)
        loader = DataLoader(data, batch_size=s.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(cfg.seed + rank))
        times, samples = [], []
        for _ in range(epochs):
            dist.barrier()
            started = time.perf_counter()
            seen = 0
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(x), y).backward()
                optimizer.step()
                seen += len(y)
            dist.barrier()
            times.append(time.perf_counter() - started)
            samples.append(seen)
        totals = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(totals)
        if rank == 0:
            _, accuracy, _ = evaluate_model(model, DataLoader(
                held_out_dataset(dataset, seed=cfg.seed), batch_size=512))
            torch.save({"epoch_s": times, "samples": totals.tolist(), "accuracy": accuracy}, out)
    finally:
        dist.destroy_process_group()


def train_central(cfg: DictConfig, *, processes: int | None = None, epochs: int = 5
                  ) -> CentralResult:
    """Train ``cfg``'s whole model data-parallel on ``processes`` cores (all by default).

    Raises
    ------
    ValueError
        If fewer than 2 epochs are asked for (the first is warm-up).
    """
    if epochs < 2:
        raise ValueError(f"epochs={epochs}: need at least 2 (the first is warm-up)")
    world = processes or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="central-") as folder:
        out = str(Path(folder) / "result.pt")
        tmp.start_processes(_train, args=(cfg, world, free_port(), epochs, out), nprocs=world,
                            join=True, start_method="spawn")
        result = torch.load(out, weights_only=True)
    steady_s, steady_samples = sum(result["epoch_s"][1:]), sum(result["samples"][1:])
    return CentralResult(world, steady_samples / steady_s, list(result["epoch_s"]),
                         float(result["accuracy"]))
