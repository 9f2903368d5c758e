"""Names shared by clients and strategies for privacy budgets (no Flower imports)."""

from __future__ import annotations

#: Status of a reply from a client that declined a round because its budget is spent
#: (the ``status`` of the reply's ``splitlearn.task.STATUS_KEY`` ConfigRecord).
BUDGET_STATUS = "budget"
#: Metric key of a client's epsilon after the round (at the configured delta).
EPSILON_METRIC = "epsilon"
