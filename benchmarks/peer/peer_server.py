"""The peer's server: its gRPC server-model service and Flower 1.9's server, one shared trunk.

``PlainSlStrategy(common_server_model=True, process_clients_as_batch=False)``: one server
model stepping once per client batch, as our SplitFed v2. Its optimiser lives for the
whole run (momentum kept across rounds, as our trunk's). After every round it evaluates
the joined model on the test split and notes the time; the last line is a JSON object
with the median round from round 2 on.
"""

import json
import time

import numpy as np
import torch
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import ServerConfig
from peer_job import (
    ADDRESS,
    CLIENTS,
    CUT,
    EPOCHS,
    JOB,
    LR,
    MOMENTUM,
    ROUNDS,
    SmallCNN,
    arrays,
    load,
)
from slwr.server.app import start_server
from slwr.server.server_model.numpy_server_model import NumPyServerModel
from slwr.server.server_model.utils import pytorch_format
from slwr.server.strategy import PlainSlStrategy

torch.set_num_threads(1)  # one intra-op thread a process, as ours
WHOLE = SmallCNN()
TRUNK = torch.nn.ModuleList(WHOLE.stages[CUT:])
BOTTOM = torch.nn.ModuleList(WHOLE.stages[:CUT])


class SharedTrunk(NumPyServerModel):
    """The stages above the cut, one optimiser for the run."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TRUNK
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.criterion = torch.nn.CrossEntropyLoss()
        self.steps = 0

    @pytorch_format
    def serve_grad_request(self, embeddings: torch.Tensor, labels: torch.Tensor
                           ) -> torch.Tensor:
        """One SGD step on a client's batch; return the gradient at the cut."""
        embeddings.requires_grad_(True)
        out = embeddings
        for stage in self.model:
            out = stage(out)
        loss = self.criterion(out, labels)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return embeddings.grad

    def get_parameters(self) -> list:
        """Return the trunk's weights."""
        return arrays(self.model)

    def get_fit_result(self) -> tuple[list, dict]:
        """Return the trunk's weights after a round."""
        return self.get_parameters(), {}

    def configure_fit(self, parameters: list, config: dict) -> None:
        """Load the round's weights in place (the optimiser keeps its momentum)."""
        load(self.model, parameters)
        self.model.train()

    def configure_evaluate(self, parameters: list, config: dict) -> None:
        """Load the weights to evaluate."""
        load(self.model, parameters)
        self.model.eval()


class TimedRounds(PlainSlStrategy):
    """The peer's strategy, starting from our weights and evaluating centrally each round."""

    def __init__(self, trunk: SharedTrunk) -> None:
        super().__init__(init_server_model_fn=lambda: trunk, min_available_clients=CLIENTS,
                         min_fit_clients=CLIENTS, fraction_evaluate=0.0,
                         min_evaluate_clients=0, common_server_model=True,
                         process_clients_as_batch=False)
        self.trunk = trunk
        self.ends: list[float] = []
        self.accuracy: list[float] = []

    def initialize_parameters(self, client_manager):
        """Start the clients from our initial weights."""
        return ndarrays_to_parameters(arrays(BOTTOM))

    def evaluate(self, server_round, client_parameters, server_parameters):
        """Central accuracy of the joined model on the test split; note the time."""
        load(BOTTOM, parameters_to_ndarrays(client_parameters))
        images, labels = JOB["test"]
        WHOLE.eval()
        with torch.no_grad():
            accuracy = float((WHOLE.run(images, 0).argmax(1) == labels).float().mean())
        WHOLE.train()
        self.ends.append(time.perf_counter())
        self.accuracy.append(accuracy)
        print(f"round {server_round} accuracy {accuracy:.4f} steps {self.trunk.steps}",
              flush=True)
        return 0.0, {"accuracy": accuracy}


def main() -> None:
    """Serve 20 rounds; print the steady round's seconds."""
    strategy = TimedRounds(SharedTrunk())
    start_server(server_address=ADDRESS, strategy=strategy,
                 config=ServerConfig(num_rounds=ROUNDS))
    steady = float(np.median(np.diff(strategy.ends[1:])))  # rounds 2.. (ends[0]: round 0)
    samples = sum(len(labels) for _, labels in JOB["parts"]) * EPOCHS
    print(json.dumps({"peer_seconds_per_round": steady, "samples_per_s": samples / steady,
                      "final_accuracy": strategy.accuracy[-1]}))


if __name__ == "__main__":
    main()
