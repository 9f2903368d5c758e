"""What a client needs to know to train one round: the ``train.split`` config.

The ServerApp builds a :class:`SplitTask` per client and round and sends it as
the Flower message's ConfigRecord; the ClientApp rebuilds it. Keeping both
directions in one class means the keys cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

#: ConfigRecord key of a reply from a client that declined the round (it holds
#: ``status``, one of unavailable / memory, and ``reason``).
STATUS_KEY = "status"


@dataclass(frozen=True)
class SplitTask:
    """One client's work for one round.

    Parameters
    ----------
    server_round : int
        Round number, from 1.
    cut : int
        Stages ``[0, cut)`` run on the client.
    model : str
        Model name in the zoo.
    model_options : str
        JSON object of model keyword arguments.
    dataset : str
        Dataset name.
    dataset_path : str
        Local dataset folder, or "" for the default source.
    test_fraction : float
        Held-out share (digits).
    image_size : int
        Images are resized to this size; 0 keeps the native size.
    partitioner : str
        Partitioner name.
    alpha : float
        Dirichlet concentration.
    shards_per_partition : int
        Shards per client for the shard partitioner.
    seed : int
        Experiment seed; batch order derives from it, the round and the partition.
    local_epochs : int
        Passes over the local data.
    batch_size : int
        Samples per batch.
    lr : float
        Client SGD learning rate.
    momentum : float
        Client SGD momentum.
    weight_decay : float
        Client SGD weight decay.
    trunk_address : str
        ``host:port`` of the trunk service.
    token : str
        Session token for this client and round.
    max_frame_bytes : int
        Largest data-plane frame.
    torch_threads : int
        Intra-op threads for the client's torch work.
    devices : str
        JSON fleet description ``{"mix": ..., "profiles": ...}``, or "" without
        device emulation; the client derives its own profile from it.
    host_flops_per_s : float
        This host's measured training FLOP/s (virtual clock); 0 when unknown.
    emulate : int
        1: the client really waits as long as its device would.
    dropout_rate : float
        Extra chance of vanishing mid-round, on top of the device's own.
    dropout_after_steps : int
        A vanishing client goes after this many batches.
    privacy : str
        Privacy option (``splitlearn.privacy.PRIVACY_OPTIONS``); "none" by default.
    privacy_clip_norm : float
        C, the per-sample L2 bound.
    privacy_noise_multiplier : float
        sigma; noise std is ``sigma * C``.
    privacy_delta : float
        The delta epsilon is reported at.
    privacy_epsilon_max : float
        Per-client epsilon budget; 0 or less for none.
    tail_cut : int
        U-shaped protocol only: the client also keeps stages
        ``[tail_cut, num_stages)`` and the loss; 0 = the last stage only.
    aux_hidden : int
        Local-loss protocol only: hidden units of the auxiliary head; 0 = one
        linear layer on the flattened activations.
    bulk : int
        Local-loss protocol only: 1 ships the round's smashed data in the
        Flower reply instead of streaming it to the trunk.
    """

    server_round: int
    cut: int
    model: str
    model_options: str
    dataset: str
    dataset_path: str
    test_fraction: float
    image_size: int
    partitioner: str
    alpha: float
    shards_per_partition: int
    seed: int
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    trunk_address: str
    token: str
    max_frame_bytes: int
    torch_threads: int = 1
    devices: str = ""
    host_flops_per_s: float = 0.0
    emulate: int = 0
    dropout_rate: float = 0.0
    dropout_after_steps: int = 2
    privacy: str = "none"
    privacy_clip_norm: float = 1.0
    privacy_noise_multiplier: float = 0.0
    privacy_delta: float = 1e-5
    privacy_epsilon_max: float = 0.0
    tail_cut: int = 0
    aux_hidden: int = 0
    bulk: int = 0

    def to_config(self) -> dict[str, int | float | str]:
        """Flatten into ConfigRecord-compatible values (keys use dashes)."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SplitTask:
        """Rebuild from a ConfigRecord; a missing or mistyped key raises ValueError."""
        values = {}
        for f in fields(cls):
            key = f.name.replace("_", "-")
            if key not in config:
                if f.default is not MISSING:
                    continue
                raise ValueError(f"train config lacks key {key!r}")
            values[f.name] = _coerce(key, config[key], f.type)
        return cls(**values)

    @property
    def resize_to(self) -> int | None:
        """Target image size, or None for the native size."""
        return self.image_size or None

    def model_kwargs(self) -> dict[str, Any]:
        """Model keyword arguments decoded from :attr:`model_options`."""
        return json.loads(self.model_options) if self.model_options else {}


def _coerce(key: str, value: Any, type_name: Any) -> Any:
    expected = {"int": int, "float": float, "str": str}[str(type_name)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, expected) or isinstance(value, bool):
        raise ValueError(
            f"train config key {key!r} has {type(value).__name__} {value!r}; "
            f"expected {expected.__name__}"
        )
    return value
