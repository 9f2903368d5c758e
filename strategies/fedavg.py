"""The baseline: the whole model trained on every device, aggregated by FedAvg.

Flower's FedAvg does the work (through :class:`SplitFed`, which adds only the
per-client table, failure handling and round timing that every protocol
reports); clients receive and return every stage and never touch the trunk.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from splitlearn.models import SplittableModel
from splitlearn.wire import state_to_record
from strategies.splitfed import SplitFed


class FedAvgBaseline(SplitFed):
    """Whole-model FedAvg (McMahan et al. 2017) with the same reporting as the split protocols."""

    train_message_type = "train.whole"

    def initial_arrays(self, model: SplittableModel) -> ArrayRecord:
        """Every stage of the model (keys ``<stage index>.<name>``)."""
        return state_to_record(model.stages.state_dict())
