"""A phone's round: its device step run by the page in its browser, through the gateway.

A node whose node config says ``device-runtime="web"`` (the gateway's SuperNodes,
:mod:`clients.gateway`) does not train in its ClientApp: the ClientApp builds the task a
page runs (:func:`phone_task`), hands it to the phone over the gateway's relay
(:func:`clients.relay.delegate`) and turns the phone's result into the same reply as any
device's (:func:`finish_on_phone`). Everything around the round (the privacy floor and
accounting, the memory check, the partial-work cap, the metrics) is the ClientApp's as for
a Python device.

The task (JSON):

``format``
    :data:`TASK_FORMAT`.
``round``, ``cut``
    The server's round and the device's cut.
``parts``
    The stages the phone trains, described for the web runtime
    (:func:`splitlearn.web.describe_stages`): the head ``[0, cut)`` and, for a protocol
    that keeps a tail on the device (U-shaped), the tail; keys are the model's.
``sgd``
    ``lr``, ``momentum``, ``weight_decay`` of the run (one SGD over every part).
``trunk``
    ``url`` (the trunk's WebSocket service), ``token`` and ``proof`` (base64 or null).
``data``
    ``id`` (a hash of the rows and labels), ``shape`` and, unless the phone holds that id
    already (the gateway says which it holds), ``inputs`` (base64 float32) and ``labels``:
    the node's partition, labels released as :class:`clients.app.ClientRound` releases
    them. For a phone that trains on its person's own pictures (``own:<n>:<hash>``, see
    :func:`own_examples`): ``id``, ``shape`` ``[n, C, H, W]``, ``own`` (true),
    ``light_on_dark`` (the dataset's grey images are light on dark: the page inverts a
    picture with a light border) and ``classes``; the rows stay on the phone.
``release``
    Under ``privacy=activation_gaussian``: ``clip_norm`` (C) and ``noise_std`` (sigma x C),
    what the head's output is released with (each row clipped to C, Gaussian noise added);
    null otherwise. The whole round is charged by the ClientApp before the task leaves.
``batches``
    Each batch's row indices, in the order a Python device of this partition trains them
    (the same sampler), capped at the round's ``max_steps``.
``deadline_s``, ``least_steps``
    Partial work: stop before a batch that would end after ``deadline_s`` of the phone's
    own time, after at least ``least_steps`` (null: no deadline).

The phone answers with ``states`` (one ``state()`` per part), and ``metrics``: ``steps``,
``examples``, ``loss_sum``, ``correct``, ``compute_s`` (its own time), ``wait_s`` (waiting
for the trunk), ``wall_s``, ``bytes_up``, ``bytes_down``, ``peak_bytes`` (TensorFlow.js's
largest allocation) and ``backend``; with its own pictures also ``classes``, how many
classes they span (the ClientApp's label coverage). What it sends is checked as any
device's reply is: the keys and shapes it was given, finite values, counts within the task.

Evaluation messages stay in the ClientApp (eager PyTorch, the same function, no update):
the node's data is there too. A phone that trains on its own pictures is not evaluated
(its ClientApp refuses: the pictures are on the phone only).
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from clients.device import DeviceFailure
from clients.relay import PhoneFailed
from clients.steps.base import ClientStep
from protocols import Protocol
from splitlearn.config import PrivacyConfig, RunSpec
from splitlearn.optim import base_lr, is_light
from splitlearn.privacy import PRIVACY_OPTIONS
from splitlearn.runtimes import web_refusal
from splitlearn.web import WebRefusal, describe_stages, device_parts, state_from_web

#: The task's format, checked by the page.
TASK_FORMAT = "splitlearn.web.task/1"
#: How a phone's data id says it holds its person's own pictures: ``own:<n>:<hash>``.
OWN_PREFIX = "own:"
#: Most pictures of its own a phone may train on (what its page keeps fits localStorage).
MAX_OWN_EXAMPLES = 2000


class PhoneLost(DeviceFailure):
    """The phone left mid-round (closed its page, lost its network) or stalled."""

    kind = "lost"


class PhoneAway(DeviceFailure):
    """No phone holds this node's slot at the gateway when the round starts."""

    kind = "unavailable"


def phone_failure(failed: PhoneFailed) -> DeviceFailure:
    """Return the device failure a relay's :class:`~clients.relay.PhoneFailed` becomes."""
    kinds: dict[str, type[DeviceFailure]] = {"lost": PhoneLost, "unavailable": PhoneAway}
    return kinds.get(failed.kind, DeviceFailure)(f"phone: {failed}")


def web_step_type(protocol: Protocol, spec: RunSpec, *, recompute: bool) -> type[ClientStep]:
    """Return the step whose stages a phone trains: the protocol's own (its modules, state, eval).

    Raises
    ------
    DeviceFailure
        The protocol's device step or the run's settings are not the web runtime's.
    """
    if "web" not in protocol.capabilities.runtimes:
        raise DeviceFailure(f"a phone (the web runtime) cannot run strategy={protocol.name}'s "
                            "device step")
    refusal = web_refusal(spec.privacy, spec.compression, recompute=recompute)
    if refusal is not None:
        raise DeviceFailure(refusal)
    if not is_light(spec.strategy.optimizer):
        raise DeviceFailure(f"a phone (the web runtime) steps plain SGD, not strategy.optimizer."
                            f"_target_={spec.strategy.optimizer._target_} with options "
                            f"{sorted(spec.strategy.optimizer.options)}")
    return protocol.client


def release_of(privacy: PrivacyConfig) -> dict[str, float] | None:
    """Return the task's ``release``: the activation mechanism's clip and noise (None: none)."""
    if not PRIVACY_OPTIONS[privacy.name].protects_activations:
        return None
    return {"clip_norm": privacy.clip_norm,
            "noise_std": privacy.noise_multiplier * privacy.clip_norm}


def own_examples(held: str | None) -> int | None:
    """Return how many pictures of its own a phone holds (None: it trains assigned data).

    Raises
    ------
    DeviceFailure
        The id says ``own:`` but not a count from 1 to :data:`MAX_OWN_EXAMPLES`.
    """
    if held is None or not held.startswith(OWN_PREFIX):
        return None
    count = held.split(":")[1] if held.count(":") == 2 else ""
    if not (count.isascii() and count.isdigit() and 1 <= int(count) <= MAX_OWN_EXAMPLES):
        raise DeviceFailure(f"phone: it says it holds {held[:40]!r}; own pictures are "
                            f"own:<1 to {MAX_OWN_EXAMPLES}>:<hash>")
    return int(count)


def round_batches(loader: DataLoader, *, epochs: int, max_steps: int | None) -> list[list[int]]:
    """Return the round's batches as row indices, in the order the loop would train them.

    A twin loader over the row indices, drawing from the same generator, draws exactly what
    iterating ``loader`` would (its sampler's permutation and the iterator's base seed), so
    a phone trains the batches a Python device of the same partition would. ``loader`` is
    not iterated after this (its generator has moved on).
    """
    rows = TensorDataset(torch.arange(len(loader.dataset)))  # type: ignore[arg-type]
    twin = DataLoader(rows, batch_size=loader.batch_size, shuffle=True,
                      generator=loader.generator)
    batches = [batch.tolist() for _ in range(epochs) for (batch,) in twin]
    return batches[:max_steps] if max_steps else batches


def phone_task(step: ClientStep, protocol: Protocol, loader: DataLoader, *, server_round: int,
               trunk: Mapping[str, Any], epochs: int, max_steps: int | None,
               deadline_s: float | None = None, least_steps: int = 1,
               holds: str | None = None) -> dict[str, Any]:
    """Return the task a phone's page trains (the format is the module docstring's).

    The rows and labels are left out when the phone ``holds`` data of the same id.

    Raises
    ------
    DeviceFailure
        A layer of the device's stages is not one the web runtime runs (named).
    """
    model, train = step.model, step.spec.strategy
    tail = protocol.first_tail_stage(train, len(model.stages))
    try:
        parts = [describe_stages(stages, shape)
                 for stages, shape in device_parts(model, step.cut, tail)]
    except WebRefusal as refusal:
        raise DeviceFailure(f"devices.web: {refusal}") from refusal
    images, labels = loader.dataset.tensors[:2]  # type: ignore[attr-defined]
    if own_examples(holds) is not None:  # ``loader`` holds only the pictures' shape
        channels = images.shape[1]
        data: dict[str, Any] = {"id": holds, "shape": list(images.shape), "own": True,
                                "light_on_dark": channels == 1, "classes": model.num_classes}
    else:
        data = partition_data(images, labels, holds=holds)
    return {
        "format": TASK_FORMAT, "round": server_round, "cut": step.cut, "parts": parts,
        "sgd": {"lr": base_lr(train, "device"), "momentum": train.momentum,
                "weight_decay": train.weight_decay},
        "trunk": dict(trunk),
        "data": data,
        "batches": round_batches(loader, epochs=epochs, max_steps=max_steps),
        "release": release_of(step.spec.privacy),
        "deadline_s": deadline_s, "least_steps": least_steps,
    }


def partition_data(images: torch.Tensor, labels: torch.Tensor, *, holds: str | None
                   ) -> dict[str, Any]:
    """Return the task's ``data`` for the node's partition: rows left out if ``holds`` them."""
    rows = images.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    label_list = [int(y) for y in labels]
    digest = hashlib.sha256(rows + repr(label_list).encode()).hexdigest()[:32]
    data: dict[str, Any] = {"id": digest, "shape": list(images.shape)}
    if holds != digest:
        data |= {"inputs": base64.b64encode(rows).decode("ascii"), "labels": label_list}
    return data


def finish_on_phone(step: ClientStep, task: Mapping[str, Any], result: Mapping[str, Any]
                    ) -> dict[str, float]:
    """Load the phone's trained stages into ``step``'s model; return its measurements.

    The measurements are :data:`METRICS`, checked; ``step.peak_memory_bytes`` becomes
    the phone's ``peak_bytes``.

    Raises
    ------
    DeviceFailure
        The result is not what the task asked for (keys, shapes, non-finite values,
        counts beyond the task's batches).
    """
    try:
        trained = _trained_state(task, result)
        metrics = _checked_metrics(task, result.get("metrics"))
    except (KeyError, TypeError, ValueError) as err:
        raise DeviceFailure(f"phone: its result is malformed ({err})") from err
    with torch.no_grad():
        step.model.stages.load_state_dict(trained, strict=False)
    step.peak_memory_bytes = int(metrics["peak_bytes"])
    return metrics


def classes_seen(task: Mapping[str, Any], result: Mapping[str, Any]) -> int | None:
    """Return how many classes a phone's own pictures span (None: it trained assigned data).

    Raises
    ------
    DeviceFailure
        The count is not a whole number from 1 to the task's classes.
    """
    if not task["data"].get("own"):
        return None
    value = result.get("metrics", {}).get("classes") if isinstance(result, Mapping) else None
    # JSON's true would pass as int 1: a count is an int and not a bool.
    if not (type(value) is int and 1 <= value <= task["data"]["classes"]):
        raise DeviceFailure(f"phone: its result says its pictures span {value!r} classes; "
                            f"the study has {task['data']['classes']}")
    return value


def _trained_state(task: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Return the phone's state of every part: the task's keys and shapes, finite."""
    states = result["states"]
    if not isinstance(states, list) or len(states) != len(task["parts"]):
        raise ValueError(f"{len(task['parts'])} part states expected")
    trained: dict[str, torch.Tensor] = {}
    for part, state in zip(task["parts"], states, strict=True):
        values = state_from_web(state)
        given = {k: v["shape"] for k, v in part["state"].items()}
        given |= dict.fromkeys(part.get("counters", {}), [])
        shapes = {k: list(v.shape) for k, v in values.items()}
        if shapes != given:
            raise ValueError(f"its state has keys and shapes {sorted(shapes.items())[:4]}..., "
                             f"the task's are {sorted(given.items())[:4]}...")
        for key, value in values.items():
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise ValueError(f"{key} is not finite")
        trained |= values
    return trained


#: The phone's measurements, each a finite number >= 0.
METRICS = ("steps", "examples", "loss_sum", "correct", "compute_s", "wait_s", "wall_s",
           "bytes_up", "bytes_down", "peak_bytes")


def _checked_metrics(task: Mapping[str, Any], metrics: Any) -> dict[str, float]:
    """Return the phone's measurements as numbers, within what the task allows."""
    if not isinstance(metrics, Mapping):
        raise ValueError("no metrics")
    checked = {}
    for key in METRICS:
        value = float(metrics[key])
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"metrics.{key}={metrics[key]!r}")
        checked[key] = value
    batches = task["batches"]
    if checked["steps"] > len(batches) or checked["examples"] > sum(map(len, batches)):
        raise ValueError(f"{checked['steps']:.0f} steps and {checked['examples']:.0f} examples, "
                         f"more than the task's {len(batches)} batches")
    if checked["correct"] > checked["examples"]:
        raise ValueError("more correct examples than examples")
    return checked
