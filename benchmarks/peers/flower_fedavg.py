"""FedAvg on the exported split with Flower's simulation engine (run by ``run.py`` in Flower's own environment).

Every client trains one epoch of LeNet (batch 64, plain SGD) from the global weights each round and every client
evaluates the new global weights on its test set (``fraction_evaluate=1``): the work of a pl_fedsparse FedAvg round
that evaluates every round. Writes the seconds of every round (from one ``aggregate_evaluate`` to the next) as JSON.

    python flower_fedavg.py --data DIR --clients 10 --rounds 6 --lr 0.05 --out times.json
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LeNet, workload_parser

_CACHE: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def load(data: Path, k: int, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's tensors, read once per worker process (Flower's clients are rebuilt for every message; the
    worker that runs them lives through the run)."""
    key = (str(data), k, part)
    if key not in _CACHE:
        d = np.load(data / part / f"{k}.npz", allow_pickle=True)["data"].tolist()
        _CACHE[key] = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    return _CACHE[key]


def main() -> None:
    p = workload_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    a = p.parse_args()
    logging.disable(logging.WARNING)
    import flwr
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import Context, ndarrays_to_parameters
    from flwr.server import ServerApp, ServerAppComponents, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.simulation import run_simulation

    data = Path(a.data)
    stamps: list[float] = []

    def params_of(model: torch.nn.Module) -> list[np.ndarray]:
        return [t.detach().cpu().numpy() for t in model.state_dict().values()]

    def set_params(model: torch.nn.Module, arrays: list[np.ndarray]) -> None:
        model.load_state_dict({n: torch.from_numpy(np.array(v)) for n, v in zip(model.state_dict(), arrays)})

    class Client(NumPyClient):
        def __init__(self, k: int) -> None:
            torch.set_num_threads(1)
            self.k, self.model = k, LeNet()

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            set_params(self.model, parameters)
            x, y = load(data, self.k, "train")
            opt = torch.optim.SGD(self.model.parameters(), lr=a.lr)
            self.model.train()
            order = torch.randperm(len(x))
            for i in range(0, len(x), a.batch):
                rows = order[i:i + a.batch]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(self.model(x[rows]), y[rows]).backward()
                opt.step()
            return params_of(self.model), len(x), {}

        def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
            set_params(self.model, parameters)
            x, y = load(data, self.k, "test")
            self.model.eval()
            correct, loss = 0, 0.0
            with torch.inference_mode():
                for i in range(0, len(x), 512):
                    out = self.model(x[i:i + 512])
                    correct += int((out.argmax(1) == y[i:i + 512]).sum())
                    loss += float(F.cross_entropy(out, y[i:i + 512], reduction="sum"))
            return loss / len(x), len(x), {"acc": correct / len(x)}

    def client_fn(context: Context):  # type: ignore[no-untyped-def]
        return Client(int(context.node_config["partition-id"])).to_client()

    class Timed(FedAvg):
        def aggregate_evaluate(self, server_round, results, failures):  # type: ignore[no-untyped-def]
            out = super().aggregate_evaluate(server_round, results, failures)
            stamps.append(time.perf_counter())
            return out

    def server_fn(context: Context) -> ServerAppComponents:
        torch.manual_seed(0)
        strategy = Timed(fraction_fit=1.0, fraction_evaluate=1.0, min_fit_clients=a.clients,
                         min_evaluate_clients=a.clients, min_available_clients=a.clients,
                         initial_parameters=ndarrays_to_parameters(params_of(LeNet())))
        stamps.append(time.perf_counter())
        return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=a.rounds))

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_simulation(server_app=ServerApp(server_fn=server_fn), client_app=ClientApp(client_fn=client_fn),
                   num_supernodes=a.clients,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 1, "address": "local"}})
    rounds = [b - a_ for a_, b in itertools.pairwise(stamps)]
    Path(a.out).write_text(json.dumps({"framework": f"flwr {flwr.__version__}", "round_s": rounds}))


if __name__ == "__main__":
    main()
