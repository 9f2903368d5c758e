"""The device's side of secure aggregation and of DP-FedAvg's clipping.

Under ``aggregation.secure`` the server runs Flower's SecAgg+ stages and every
stage arrives as a plain ``train`` message: Flower's ``secaggplus_mod`` answers
the key stages itself and, in stage 2, calls the ClientApp's ``train`` handler,
which trains the message's protocol as usual and hands the mod the *update*
(new weights minus those it was sent) in Flower's FitRes layout. The mod
quantises and masks it; the server only ever unmasks the round's sum.

A device that declines the round (out of budget, memory, ...) hands the mod a
zero update of weight zero and keeps its status record, so the round's masks
still cancel and the server still learns why. A device whose update would not
fit SecAgg+'s quantisation range refuses to mask it (it would be clipped
silently) and says by how much.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, compute_clip_model_update

from splitlearn.messages import STATUS_KEY, UPDATE_WEIGHT_KEY

__all__ = ["SecureAggregationRangeError", "clip_update", "masked_update", "secaggplus_mod"]


class SecureAggregationRangeError(ValueError):
    """The update does not fit SecAgg+'s quantisation range (it would be clipped)."""


def clip_update(returned: ArrayRecord, sent: ArrayRecord, config: dict) -> ArrayRecord:
    """Clip the update to the bound DP-FedAvg's wrapper sent (Flower's own clipping).

    Only floating arrays are learned weights; integer buffers (batch norm's
    ``num_batches_tracked``) count batches and are left as they are.

    Parameters
    ----------
    returned : ArrayRecord
        The weights after training.
    sent : ArrayRecord
        The weights the device was sent.
    config : dict
        The message's config record; without ``KEY_CLIPPING_NORM`` nothing is clipped.
    """
    if KEY_CLIPPING_NORM not in config:
        return returned
    learned = [k for k, a in returned.items() if np.issubdtype(a.numpy().dtype, np.floating)]
    new = [returned[k].numpy().astype(np.float64) for k in learned]
    compute_clip_model_update(param1=new, param2=[sent[k].numpy() for k in learned],
                              clipping_norm=float(config[KEY_CLIPPING_NORM]))
    clipped = dict(returned.items())
    for key, values in zip(learned, new, strict=True):
        clipped[key] = Array(values.astype(returned[key].numpy().dtype))
    return ArrayRecord(clipped)


def masked_update(msg: Message, reply: Message, context: Context) -> Message:
    """Return ``reply`` laid out as the FitRes ``secaggplus_mod`` masks: update and weight.

    Parameters
    ----------
    msg : Message
        The stage-2 message (the protocol's own content plus SecAgg+'s config).
    reply : Message
        The protocol's train reply (or a declined device's status reply).
    context : Context
        The node's context, whose state holds SecAgg+'s ranges from stage 0.
    """
    sent = msg.content["arrays"]
    metrics = reply.content.metric_records.get("metrics", MetricRecord())
    declined = reply.content.config_records.get(STATUS_KEY)
    if declined is not None:
        update, weight = [np.zeros(a.shape) for a in sent.values()], 0
    else:
        returned = reply.content["arrays"]
        if list(returned.keys()) != list(sent.keys()) or len(reply.content.array_records) != 1:
            raise ValueError("secure aggregation masks the weights the device was sent, and "
                             f"nothing else; the reply holds {list(reply.content.array_records)}")
        update = [returned[k].numpy().astype(np.float64) - sent[k].numpy() for k in sent]
        weight = 1 if UPDATE_WEIGHT_KEY in metrics else int(metrics["num-examples"])
        _check_range(update, weight, SecAggPlusState(**context.state[RECORD_KEY_STATE]))
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), weight, {})
    content = fitres_to_recorddict(fitres, keep_input=False)
    content["metrics"] = metrics
    if declined is not None:
        content[STATUS_KEY] = declined
    return Message(content, reply_to=msg)


def _check_range(update: list[np.ndarray], weight: int, state: SecAggPlusState) -> None:
    """Refuse an update that SecAgg+ would clip: each coordinate x its weight share."""
    share = weight / state.max_weight
    if share > 1:
        raise SecureAggregationRangeError(
            f"this device's weight ({weight} examples) exceeds aggregation.max_weight="
            f"{state.max_weight:g}; the masked sum would overflow (raise aggregation.max_weight)")
    peak = max((float(np.abs(u).max()) for u in update if u.size), default=0.0) * share
    if peak > state.clipping_range:
        raise SecureAggregationRangeError(
            f"the update reaches {peak:.4g} (x its weight share {share:.3g}), beyond "
            f"aggregation.clipping_range={state.clipping_range:g}: SecAgg+ would clip it "
            "(raise aggregation.clipping_range or aggregation.max_weight)")


def secure_train_handler(train: Callable[[Message, Context], Message],
                         declines: Callable[..., Message]) -> Callable[[Message, Context], Message]:
    """Return the ClientApp's ``train`` handler: the protocol's round, as a maskable update.

    ``declines`` is the ClientApp's status mod: a device that declines inside the
    handler still answers SecAgg+ (with a zero update of weight zero).
    """
    def handle(msg: Message, context: Context) -> Message:
        return masked_update(msg, declines(msg, context, train), context)

    return handle
