"""The peer's 10 clients, as threads of one process.

Flower's client registers a SIGINT handler, which only a main thread may do: left out.
"""

import threading

import flwr.client.app as flwr_client_app
import torch
from peer_job import ADDRESS, BATCH, CLIENTS, CUT, EPOCHS, JOB, LR, MOMENTUM, SmallCNN, arrays, load
from slwr.client.app import start_client
from slwr.client.numpy_client import NumPyClient

torch.set_num_threads(1)
flwr_client_app._AppStateTracker.register_signal_handler = lambda self: None


class Device(NumPyClient):
    """One client: its partition, the stages below the cut, a fresh optimiser each round."""

    def __init__(self, partition: int) -> None:
        super().__init__()
        self.partition = partition
        self.bottom = torch.nn.ModuleList(SmallCNN().stages[:CUT])

    def get_parameters(self, config: dict) -> list:
        """Return the client-side weights."""
        return arrays(self.bottom)

    def fit(self, parameters: list, config: dict) -> tuple[list, int, dict]:
        """Two local epochs of batches of 32 through the shared trunk."""
        self.server_model_proxy.torch()
        load(self.bottom, parameters)
        optimizer = torch.optim.SGD(self.bottom.parameters(), lr=LR, momentum=MOMENTUM)
        data = torch.utils.data.TensorDataset(*JOB["parts"][self.partition])
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)
        for _ in range(EPOCHS):
            for images, labels in loader:
                out = images
                for stage in self.bottom:
                    out = stage(out)
                grad = self.server_model_proxy.serve_grad_request(embeddings=out, labels=labels)
                optimizer.zero_grad()
                out.backward(grad)
                optimizer.step()
        return arrays(self.bottom), len(data), {}

    def evaluate(self, parameters: list, config: dict) -> tuple[float, int, dict]:
        """Unused: the server evaluates centrally."""
        return 0.0, 1, {}


def main() -> None:
    """Connect the 10 clients and wait until the server ends the run."""
    threads = [threading.Thread(target=start_client, kwargs={
        "server_address": ADDRESS,
        "client_fn": lambda cid, partition=partition: Device(partition).to_client()})
        for partition in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
