"""FedAvg on the exported split with PFLlib's own server and clients (run by ``run.py`` in PFLlib's environment,
from PFLlib's ``system`` folder, which reads ``../dataset/<name>/{train,test}/<k>.npz``).

PFLlib's ``FedAvg`` server as its ``main.py`` would build it (the arguments below are ``main.py``'s defaults except
the workload's), with LeNet in place of its model zoo. Each PFLlib round evaluates the global model on every client
(test accuracy, and the training loss over every client's training data: PFLlib's own default) and then trains every
client for one epoch. Writes PFLlib's own per-round times (``server.Budget``) as JSON.

    python pfllib_fedavg.py --dataset NAME --clients 10 --rounds 6 --lr 0.05 --out times.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())  # PFLlib's system/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import LeNet, workload_parser


def main() -> None:
    p = workload_parser(__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from flcore.servers.serveravg import FedAvg

    args = argparse.Namespace(
        goal="peers", device="cpu", device_id="0", dataset=a.dataset, num_classes=10, model=LeNet(),
        batch_size=a.batch, local_learning_rate=a.lr, learning_rate_decay=False, learning_rate_decay_gamma=0.99,
        global_rounds=a.rounds - 1, top_cnt=100, local_epochs=1, algorithm="FedAvg", join_ratio=1.0,
        random_join_ratio=False, num_clients=a.clients, prev=0, times=1, eval_gap=1, save_folder_name="items",
        auto_break=False, dlg_eval=False, dlg_gap=100, batch_num_per_client=2, num_new_clients=0,
        fine_tuning_epoch_new=0, feature_dim=512, vocab_size=80, max_len=200, few_shot=0, client_drop_rate=0.0,
        train_slow_rate=0.0, send_slow_rate=0.0, time_select=False, time_threthold=10000)
    server = FedAvg(args, 0)
    server.train()
    Path(a.out).write_text(json.dumps({"framework": "PFLlib", "round_s": list(server.Budget),
                                       "acc": list(server.rs_test_acc)}))


if __name__ == "__main__":
    main()
