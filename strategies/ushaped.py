"""U-shaped split learning: labels never leave the device.

Vepakomma et al. 2018, "Split learning for health: Distributed deep learning
without sharing raw patient data", U-shaped configuration. Each device keeps
the first stages (``[0, cut)``), the last stages (``[tail_cut, num_stages)``)
and the loss; the server's trunk runs the stages in between. Per batch there
are two data-plane exchanges (features out, gradient back; see
:mod:`server.trunk_ushaped`), and no frame carries labels.

Built on :class:`SplitFed` at its hooks: ``train.ushaped`` messages, client-side
arrays that hold head *and* tail stages (keys ``"<stage index>.…"``, so FedAvg
and the centralised evaluation, which loads them into the server's model, work
unchanged), and ``evaluate.ushaped`` for federated evaluation (the loss is
computed on the device there too). The session tokens carry ``tail_cut`` (the
builder in ``server/app.py`` issues them), which is what makes the trunk treat
a session as U-shaped.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import log
from flwr.serverapp import Grid

from splitlearn.models import SplittableModel
from splitlearn.split import ushaped_state
from splitlearn.wire import state_to_record
from strategies.splitfed import SplitFed


class UShapedSplit(SplitFed):
    """U-shaped split learning (head and tail on the device) on one shared trunk.

    Parameters
    ----------
    **kwargs : Any
        Passed to :class:`SplitFed`; ``task.tail_cut`` must be resolved (the
        first stage of the device's tail, ``cut < tail_cut < num_stages``).
    """

    train_message_type = "train.ushaped"
    #: Federated evaluation also keeps the loss (and so the labels) on the device.
    evaluate_message_type = "evaluate.ushaped"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.task.cut < self.task.tail_cut:
            raise ValueError(
                f"U-shaped split needs cut < tail_cut; got cut={self.task.cut}, "
                f"tail_cut={self.task.tail_cut} (resolve 0 with splitlearn.split.resolve_tail_cut)"
            )

    def initial_arrays(self, model: SplittableModel) -> ArrayRecord:
        """Head and tail stages that round 1 starts from (keys ``"<stage index>.…"``)."""
        return state_to_record(ushaped_state(model, self.task.cut, self.task.tail_cut))

    def summary(self) -> None:
        """Log the split settings with the tail cut."""
        super().summary()
        log(INFO, "\t└──> U-shaped: the device keeps stages %d.. and the loss", self.task.tail_cut)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation with the loss on the device (``evaluate.ushaped``)."""
        return [
            Message(
                content=m.content,
                dst_node_id=m.metadata.dst_node_id,
                message_type=self.evaluate_message_type,
            )
            for m in super().configure_evaluate(server_round, arrays, config, grid)
        ]
