"""Model inversion: reconstruct inputs from what a client releases at the cut.

The attacker is the server, which in SplitFed holds the client-side weights
(clients upload them every round) and knows the release mechanism (clip norm
and noise multiplier are in the config it sends). It trains a decoder on pairs
(released activations, input) computed from auxiliary data it owns, drawing
fresh noise every epoch, then decodes the released rows of the target inputs
(He et al., "Model inversion attacks against collaborative inference", 2019:
the "inverse network" attack). One release per target is decoded, or the average
of several when the server can link them (:func:`linked_releases`).
:func:`optimise_inversion` is the white-box attack beside it: a search in input
space through the device's own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from splitlearn.attacks.similarity import mse, ssim


class InversionDecoder(nn.Module):
    """An MLP from flattened released activations to an image in [0, 1].

    Parameters
    ----------
    in_features : int
        Size of one flattened released activation.
    out_shape : tuple[int, ...]
        Shape of one input image ``(C, H, W)``.
    hidden : int
        Width of the two hidden layers. Default 512: enough to invert the
        8x8 digits from any cut of the small CNN in a few seconds on a CPU.
    """

    def __init__(self, *, in_features: int, out_shape: tuple[int, ...], hidden: int = 512) -> None:
        super().__init__()
        self.out_shape = tuple(out_shape)
        out_features = int(torch.Size(out_shape).numel())
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, out_features), nn.Sigmoid(),
        )

    def forward(self, released: Tensor) -> Tensor:
        """Reconstruct a batch of images from released activations."""
        return self.net(released).reshape(-1, *self.out_shape)


@dataclass(frozen=True)
class InversionResult:
    """How well a decoder reconstructs held-out inputs.

    Parameters
    ----------
    mse : float
        Mean squared error per pixel, averaged over targets.
    ssim : float
        Mean SSIM over targets (1 = perfect).
    reconstructions : Tensor
        The decoded targets.
    """

    mse: float
    ssim: float
    reconstructions: Tensor


def train_decoder(
    release: Callable[[Tensor], Tensor],
    aux_inputs: Tensor,
    *,
    epochs: int = 150,
    batch_size: int = 128,
    lr: float = 1e-3,
    generator: torch.Generator | None = None,
) -> InversionDecoder:
    """Train a decoder on (``release(x)``, x) for the auxiliary inputs.

    Parameters
    ----------
    release : Callable[[Tensor], Tensor]
        Inputs -> released activations, drawing fresh noise on each call.
    aux_inputs : Tensor
        The attacker's own images, ``(n, C, H, W)`` in [0, 1].
    epochs, batch_size, lr : int, int, float
        Adam training settings.
    generator : torch.Generator, optional
        Shuffling and initialisation randomness.

    Returns
    -------
    InversionDecoder
        The trained decoder (eval mode).
    """
    with torch.no_grad():
        probe = release(aux_inputs[:1])
    if generator is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=generator)))
            decoder = InversionDecoder(in_features=probe[0].numel(), out_shape=aux_inputs.shape[1:])
    else:
        decoder = InversionDecoder(in_features=probe[0].numel(), out_shape=aux_inputs.shape[1:])
    optimizer = torch.optim.Adam(decoder.parameters(), lr=lr)
    decoder.train()
    for _ in range(epochs):
        with torch.no_grad():
            released = release(aux_inputs)  # fresh noise each epoch
        order = torch.randperm(len(aux_inputs), generator=generator)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(decoder(released[idx]), aux_inputs[idx])
            loss.backward()
            optimizer.step()
    return decoder.eval()


def invert(
    release: Callable[[Tensor], Tensor],
    *,
    aux_inputs: Tensor,
    targets: Tensor,
    epochs: int = 150,
    generator: torch.Generator | None = None,
) -> InversionResult:
    """Train a decoder on auxiliary data, then reconstruct ``targets`` from one release each.

    Parameters
    ----------
    release : Callable[[Tensor], Tensor]
        Inputs -> released activations (what the client sends).
    aux_inputs : Tensor
        The attacker's images, disjoint from ``targets``.
    targets : Tensor
        The private images whose releases are attacked.
    epochs : int
        Decoder training epochs.
    generator : torch.Generator, optional
        Decoder training randomness.

    Returns
    -------
    InversionResult
        MSE and SSIM of the reconstructions against ``targets``.
    """
    decoder = train_decoder(release, aux_inputs, epochs=epochs, generator=generator)
    with torch.no_grad():
        reconstructions = decoder(release(targets))
    return InversionResult(
        mse=float(mse(reconstructions, targets).mean()),
        ssim=float(ssim(reconstructions, targets).mean()),
        reconstructions=reconstructions,
    )


def linked_releases(release: Callable[[Tensor], Tensor], count: int) -> Callable[[Tensor], Tensor]:
    """Return a release that averages ``count`` independent releases of the same inputs.

    What a server gains when it can link an example's releases (the same batch
    order every epoch, repeated evaluations): fresh noise averages down by
    ``sqrt(count)``. Decoding it with :func:`invert` trains the decoder on averaged
    auxiliary releases too, as the attacker would.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")

    def averaged(inputs: Tensor) -> Tensor:
        return torch.stack([release(inputs) for _ in range(count)]).mean(dim=0)

    return averaged


def total_variation(images: Tensor) -> Tensor:
    """Mean absolute difference between neighbouring pixels (a smoothness prior)."""
    across = (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    down = (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    return across + down


def optimise_inversion(
    forward: Callable[[Tensor], Tensor],
    released: Tensor,
    *,
    shape: tuple[int, ...],
    steps: int = 300,
    lr: float = 0.1,
    tv_weight: float = 0.01,
) -> Tensor:
    """White-box inversion: the images whose release is nearest to ``released``.

    The server holds the device's layers (uploaded every round) and knows the
    deterministic part of the release (clipping), so it searches input space for
    images whose activations match what it received (He et al. 2019's white-box
    attack; "rMLE" with a total-variation prior). Pixels are a sigmoid of free
    parameters, so they stay in [0, 1].

    Parameters
    ----------
    forward : Callable[[Tensor], Tensor]
        Images -> the release without its noise (the device's layers, then clipping);
        differentiable.
    released : Tensor
        What the device sent, one row per target.
    shape : tuple[int, ...]
        One image's shape ``(C, H, W)``.
    steps, lr : int, float
        Adam iterations and step size.
    tv_weight : float
        Weight of :func:`total_variation` relative to the mean squared activation error.

    Returns
    -------
    Tensor
        The reconstructions, ``(len(released), *shape)`` in [0, 1].
    """
    logits = torch.zeros(len(released), *shape, requires_grad=True)  # grey images
    optimizer = torch.optim.Adam([logits], lr=lr)
    target = released.detach().flatten(1)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        images = torch.sigmoid(logits)
        error = (forward(images).flatten(1) - target).pow(2).mean()
        (error + tv_weight * total_variation(images)).backward()
        optimizer.step()
    return torch.sigmoid(logits).detach()
