"""Label leakage from the cut-layer gradients the trunk returns (Li et al., 2022).

In the non-U-shaped protocols the trunk computes the loss, so the gradient it
sends back for sample i is ``J_i^T (softmax_i - onehot(y_i)) / B``: it depends
on the label. Whoever sees these gradients but not the labels (a party that
holds features only, or anyone on the return path) can score each sample:

* **norm attack**: the gradient's L2 norm (large when the model is unsure,
  which in skewed binary tasks means the rare class; scored one-vs-rest per
  class and averaged for multi-class data);
* **direction attack**: cosine similarity with the gradient of one example
  whose label the attacker knows (same label: similar direction).

Both are scored with ROC AUC (0.5 = no leak, 1 = labels recovered).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from splitlearn.privacy.mechanism import per_sample_norms


def roc_auc(scores: Tensor, positives: Tensor) -> float:
    """Area under the ROC curve (scikit-learn's): P(a positive outscores a negative), ties half.

    Raises
    ------
    ValueError
        If ``positives`` (boolean, shape ``(n,)``) does not hold both classes.
    """
    positives = positives.bool().flatten()
    n_pos = int(positives.sum())
    if n_pos == 0 or n_pos == len(positives):
        raise ValueError(f"need positives and negatives, got {n_pos} and {len(positives) - n_pos}")
    from sklearn.metrics import roc_auc_score  # scikit-learn's metrics import in seconds

    return float(roc_auc_score(positives.numpy(), scores.double().flatten().numpy()))

def cut_layer_gradients(trunk: nn.Module, released: Tensor, labels: Tensor) -> Tensor:
    """Return the gradient the trunk sends back: d(mean cross-entropy)/d(released).

    Parameters
    ----------
    trunk : nn.Module
        Server-side stages.
    released : Tensor
        What the client sent, ``(B, ...)``.
    labels : Tensor
        Class labels, ``(B,)``.

    Returns
    -------
    Tensor
        Same shape as ``released``; row i is sample i's gradient.
    """
    acts = released.detach().requires_grad_(True)
    loss = nn.functional.cross_entropy(trunk(acts), labels)
    (grad,) = torch.autograd.grad(loss, acts)
    return grad


def _one_vs_rest(scores_per_class: dict[int, tuple[Tensor, Tensor]]) -> float:
    aucs = [
        roc_auc(scores, positives)
        for scores, positives in scores_per_class.values()
        if 0 < int(positives.sum()) < len(positives)
    ]
    if not aucs:
        raise ValueError("no class has both positives and negatives")
    return sum(aucs) / len(aucs)


def norm_attack_auc(grads: Tensor, positives: Tensor) -> float:
    """ROC AUC of the gradient norm as a score for the positive class (Li et al.'s norm attack).

    Parameters
    ----------
    grads : Tensor
        Per-sample cut-layer gradients, ``(n, ...)``.
    positives : Tensor
        Boolean ``(n,)``: which samples carry the positive label.

    Returns
    -------
    float
        1 when every positive has a larger gradient norm than every negative.
    """
    return roc_auc(per_sample_norms(grads), positives)


def one_vs_rest_norm_auc(grads: Tensor, labels: Tensor) -> float:
    """Run the norm attack for each class against the rest; average over classes.

    The norm reflects how unsure the model is about a sample, not which class
    it has: it singles out a class only when that class is systematically
    harder (Li et al.'s skewed binary tasks). On balanced multi-class data
    this is near 0.5 even when the labels leak through the gradient's direction.

    Parameters
    ----------
    grads : Tensor
        Per-sample cut-layer gradients, ``(n, ...)``.
    labels : Tensor
        True labels, ``(n,)``.

    Returns
    -------
    float
        Mean AUC over the classes present.
    """
    norms = per_sample_norms(grads)
    return _one_vs_rest({int(c): (norms, labels == c) for c in labels.unique()})


def direction_attack_auc(
    grads: Tensor, labels: Tensor, *, generator: torch.Generator | None = None
) -> float:
    """Mean one-vs-rest ROC AUC of the cosine with one known example of each class.

    For every class the attacker knows the label of one random example of it;
    the other examples are scored by cosine similarity with that example's
    gradient. The known examples are left out of the scoring.

    Parameters
    ----------
    grads : Tensor
        Per-sample cut-layer gradients, ``(n, ...)``.
    labels : Tensor
        True labels, ``(n,)``.
    generator : torch.Generator, optional
        Picks the known examples.

    Returns
    -------
    float
        Mean AUC over classes with at least two examples.
    """
    flat = nn.functional.normalize(grads.reshape(len(grads), -1).double(), dim=1)
    per_class = {}
    for c in labels.unique():
        members = (labels == c).nonzero().squeeze(1)
        if len(members) < 2:
            continue
        known = members[torch.randint(len(members), (1,), generator=generator)]
        rest = torch.ones(len(labels), dtype=torch.bool)
        rest[known] = False
        scores = flat[rest] @ flat[known].squeeze(0)
        per_class[int(c)] = (scores, labels[rest] == c)
    return _one_vs_rest(per_class)
