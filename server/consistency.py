"""Whether a U-shaped device's returned gradient is one some labelling of its batch explains.

A U-shaped device keeps its labels and loss; the trunk learns from the gradient it returns
at the tail cut, ``d (mean loss) / d features``. A device that negates it (gradient ascent)
within every norm bound pushed the shared trunk up everyone's loss: 1 device in 10 cost
the default job up to 4 points, 2 in 10 all of it. But an honest gradient has a shape no
norm bound looks at: for each example it is ``J^T (p - e_y) / B``, the device's tail's
Jacobian at the features it received times its softmax minus the one-hot of its label, over
its batch size.

The server can compute that for every candidate label if it knows the device's tail. It
knows the round's first one (the merged device tails), and an honest device changes its
tail only by SGD steps on its own batches, with the run's optimiser settings: each
:class:`DeviceTails` replica replays those steps from the labels the check finds, so it
stays the device's own tail batch after batch (exactly, when nothing is compressed,
noised, dropped out or normalised by batch). :func:`label_consistency` then finds, row by
row, the label whose gradient is nearest the returned one and how far the batch is from
that labelling. A made-up gradient cannot be explained by any labelling through the tail
the server replays; a device that lies about its labels instead (a consistent gradient of
wrong labels) is left to the loss those labels give, which the guard checks as it checks
the trunk's own loss (:meth:`server.guard.TrunkGuard.check_returned`).
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from splitlearn.config import OptimizerConfig
from splitlearn.optim import Optimizer, make_optimizer


@dataclass(frozen=True)
class Consistency:
    """How well some labelling explains a returned gradient (:func:`label_consistency`)."""

    #: The batch's distance from the nearest labelling's gradients over the larger of
    #: their norm and the returned one's: 0 exactly explained, 1 or more for an ascent.
    residual: float
    labels: Tensor  # that labelling, per example
    losses: Tensor  # each example's loss under it, through the tail
    classes: int
    probs: Tensor  # the tail's softmax of each example (what the replica's step starts from)


def frozen_tail(stages: Sequence[nn.Module]) -> nn.Module:
    """Return a copy of a device tail's stages in eval mode that nothing trains."""
    tail = copy.deepcopy(nn.Sequential(*stages)).eval()
    tail.requires_grad_(False)
    return tail


def label_consistency(tail: nn.Module, features: Tensor, grad: Tensor) -> Consistency | None:
    """Find the labelling whose gradient is nearest a U-shaped device's returned one.

    Parameters
    ----------
    tail : nn.Module
        The device's tail as the server knows it (its mode is left as it is: a replica
        in eval mode, so that rows are independent).
    features : Tensor
        What the trunk sent for the batch.
    grad : Tensor
        What came back: ``d (mean loss) / d features``, ``B`` rows.

    Returns
    -------
    Consistency or None
        None for a tail whose output is not one row of logits per example.

    Notes
    -----
    With ``J_i`` the tail's Jacobian at row ``i`` and ``p_i`` its softmax, the honest row
    times ``B`` is ``J_i^T p_i - J_i^T e_y``: the candidates ``J_i^T e_c`` come from backward
    passes through the tail batched over the rows and the labels (:func:`_class_rows`), or,
    for a tail that is one ``nn.Linear``, are its weight's rows (a tenth of the time). The
    residual is the Frobenius distance of the batch from the nearest labelling's gradients over
    the larger of their norm and the returned batch's: a negated gradient is at 1 or
    more however it is scaled; a batch the model already fits (both near 0) is compared
    on its own scale, not blown up by dividing by a near-zero norm.
    """
    rows = len(features)
    linear = _lone_linear(tail)
    if linear is not None and features.dim() == 2 and rows:  # the Jacobian is the weight
        with torch.no_grad():
            inputs = features.detach().float()
            logits = linear(inputs)
            probs = logits.softmax(dim=1)
            classes = logits.shape[1]
            weight = linear.weight.float()
            along_p = probs @ weight
            returned = rows * grad.detach().float().flatten(1)
            distances = torch.cdist(along_p - returned, weight,  # rows x classes, exactly
                                    compute_mode="donot_use_mm_for_euclid_dist")
            nearest, labels = distances.min(dim=1)
            chosen = weight[labels]
    else:
        found = _nearest_labels(tail, features, grad)
        if found is None:
            return None
        along_p, returned, nearest, labels, chosen, probs = found
        classes = probs.shape[1]
    scale = max(float((along_p - chosen).norm()), float(returned.norm()))
    residual = float(nearest.norm()) / scale if scale > 0 else 0.0
    losses = -probs.gather(1, labels[:, None]).squeeze(1).clamp_min(1e-30).log()
    return Consistency(residual, labels, losses, classes, probs)


def _lone_linear(tail: nn.Module) -> nn.Linear | None:
    """Return the tail's only module when it is an ``nn.Linear`` (the common last stage)."""
    while isinstance(tail, nn.Sequential) and len(tail) == 1:
        tail = tail[0]
    return tail if isinstance(tail, nn.Linear) else None


def _nearest_labels(tail: nn.Module, features: Tensor, grad: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """Find each row's nearest label through autograd, for any tail (None: no logits).

    Returns ``J^T p``, the returned rows times B, each row's nearest distance and label,
    that label's ``J^T e_y`` and the softmax.
    """
    rows = len(features)
    with torch.enable_grad():
        inputs = features.detach().float().requires_grad_(True)
        logits = tail(inputs)
        if logits.dim() != 2 or len(logits) != rows or rows == 0:
            return None
        classes = logits.shape[1]
        probs = logits.detach().softmax(dim=1)
        (along_p,) = torch.autograd.grad(logits, inputs, probs, retain_graph=True)
        along_p = along_p.flatten(1)
        returned = rows * grad.detach().float().flatten(1)
        wanted = along_p - returned  # what J^T e_y must be for an honest row
        nearest = torch.full((rows,), math.inf)
        labels = torch.zeros(rows, dtype=torch.long)
        chosen = torch.zeros_like(wanted)
        for first in range(0, classes, CLASSES_AT_ONCE):
            block = _class_rows(logits, inputs, range(first, min(classes, first + CLASSES_AT_ONCE)))
            distance = (wanted.unsqueeze(0) - block).norm(dim=2)  # classes of the block x rows
            best, at = distance.min(dim=0)
            closer = best < nearest
            nearest = torch.where(closer, best, nearest)
            labels = torch.where(closer, at + first, labels)
            chosen[closer] = block[at[closer], closer.nonzero().squeeze(1)]
    return along_p, returned, nearest, labels, chosen, probs


#: Candidate labels whose Jacobian rows are computed in one batched backward pass (a
#: block's rows x classes x features are held at once).
CLASSES_AT_ONCE = 64


def _class_rows(logits: Tensor, inputs: Tensor, labels: range) -> Tensor:
    """Return ``J_i^T e_c`` for every row ``i`` and label ``c`` in ``labels`` (c x rows x d).

    One vectorised backward pass (``is_grads_batched``; an operation without a batching
    rule falls back to a loop inside autograd).
    """
    rows, classes = logits.shape
    onehots = torch.zeros(len(labels), rows, classes, dtype=logits.dtype)
    for index, label in enumerate(labels):
        onehots[index, :, label] = 1.0
    (block,) = torch.autograd.grad(logits, inputs, onehots, retain_graph=True,
                                   is_grads_batched=True)
    return block.flatten(2)


class DeviceTails:
    """Each U-shaped device's tail this round, as its own SGD steps leave it.

    Parameters
    ----------
    lr, momentum, weight_decay : float
        The devices' optimiser settings: base learning rate, SGD's momentum, weight decay.
    optimizer : OptimizerConfig, optional
        The devices' optimiser (None: plain SGD).
    lr_factor : Callable[[], float], optional
        The schedule's factor this round (a replica made now trains at ``lr`` times it).
    """

    def __init__(self, *, lr: float, momentum: float, weight_decay: float,
                 optimizer: OptimizerConfig | None = None,
                 lr_factor: Callable[[], float] = lambda: 1.0) -> None:
        self.hyper = {"momentum": momentum, "weight_decay": weight_decay}
        self.lr = lr
        self.optimizer = optimizer or OptimizerConfig()
        self.lr_factor = lr_factor
        self._lock = threading.Lock()
        # client -> (round, its tail replica, that replica's optimiser)
        self._tails: dict[str, tuple[int, nn.Module, Optimizer]] = {}
        self._round = 0  # the latest round seen

    def tail(self, client: str, server_round: int,
             stages: Callable[[], Sequence[nn.Module]]) -> nn.Module:
        """Return ``client``'s replica for ``server_round``, copied from ``stages()`` if new.

        ``stages`` gives the round's device tail (the trunk's copy of the merged tails);
        it is called only when the replica is made, once per client and round.
        The replica is in eval mode; one client's frames come one at a time, so only its
        own session uses it.
        """
        with self._lock:
            if server_round > self._round:  # a new round: the last one's devices are done
                self._round = server_round
                self._tails = {c: k for c, k in self._tails.items() if k[0] >= server_round}
            kept = self._tails.get(client)
            if kept is None or kept[0] != server_round:
                replica = copy.deepcopy(nn.Sequential(*stages())).eval()
                replica.requires_grad_(True)
                optimizer = make_optimizer(replica.parameters(), self.optimizer,
                                           lr=self.lr * self.lr_factor(), **self.hyper)
                kept = self._tails[client] = (server_round, replica, optimizer)
            return kept[1]

    def learn(self, client: str, features: Tensor, labels: Tensor,
              probs: Tensor | None = None) -> None:
        """Replay ``client``'s tail step on its batch (the labels the check found).

        For a tail that is one ``nn.Linear``, with ``probs`` (its softmax of the batch,
        from the check, which this overwrites), the gradient is ``(probs - onehot)^T
        features / B`` (and its mean for the bias), without autograd; any other tail's
        comes from autograd, in train mode as the device trains it.
        """
        with self._lock:
            kept = self._tails.get(client)
        if kept is None:
            return
        _, replica, optimizer = kept
        linear = _lone_linear(replica)
        if linear is not None and probs is not None and features.dim() == 2:
            with torch.no_grad():
                error = probs  # consumed: the check's softmax is not read again
                error[torch.arange(len(labels)), labels] -= 1.0
                error /= len(labels)
                linear.weight.grad = (error.T @ features.float()).to(linear.weight.dtype)
                if linear.bias is not None:
                    linear.bias.grad = error.sum(dim=0).to(linear.bias.dtype)
            optimizer.step()
            optimizer.zero_grad()
            return
        replica.train()  # as the device trains it (batch norm's batch statistics)
        try:
            with torch.enable_grad():
                loss = nn.functional.cross_entropy(replica(features.detach().float()), labels)
                params = [p for p in replica.parameters() if p.requires_grad]
                for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
                    param.grad = grad
            optimizer.step()
            optimizer.zero_grad()
        finally:
            replica.eval()

    def forget(self) -> None:
        """Drop every replica (the round ended: the next starts from the merged tails)."""
        with self._lock:
            self._tails.clear()
