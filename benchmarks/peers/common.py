"""What the peers' scripts share: LeNet-CIFAR as plain PyTorch (their virtual environments do not install
pl_fedsparse) and the workload's command line.

The same layers, shapes and parameter order as :class:`pl_fedsparse.models.LeNetCIFAR` (``run.py`` checks that the
state dicts match name by name and shape by shape before any run): conv5x5(3->32)-ReLU-pool2,
conv5x5(32->64)-ReLU-pool2, fc 1600->120-ReLU, fc 120->84-ReLU, fc 84->10.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.fc1 = nn.Linear(64 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments ``run.py`` passes every peer script (a script adds where its data is)."""
    p = argparse.ArgumentParser(description=doc)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", required=True, help="the per-round seconds as JSON")
    return p
