"""``executors.base.local_gradients``: the dense gradients summed over a few batches (what gradient regrowth scores),
accumulated by multi-tensor operations — the same sums as adding each batch's gradient tensor by tensor."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pl_fedsparse.executors.base import local_gradients


class _Net(nn.Module):
    """Token ids -> an embedding (sparse gradients when asked) -> a linear classifier."""

    def __init__(self, sparse: bool, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6, sparse=sparse)
        self.body = nn.ModuleList(nn.Linear(6, 6) for _ in range(layers))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for layer in self.body:
            h = torch.tanh(layer(h))
        return self.head(h)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(n)
    return [(torch.randint(0, 11, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _by_hand(net: nn.Module, batches: list, names: list[str]) -> dict[str, torch.Tensor]:
    params = dict(net.named_parameters())
    total = {n: torch.zeros_like(params[n]) for n in names}
    for x, y in batches:
        net.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        for n in names:
            grad = params[n].grad
            total[n].add_(grad)  # (what the sums were before: one tensor at a time)
    net.zero_grad(set_to_none=True)
    return total


def test_the_sums_are_the_batches_gradients_added_one_by_one() -> None:
    for sparse in (False, True):  # (an embedding's sparse gradient is added on its own)
        torch.manual_seed(0)
        net = _Net(sparse)
        names = ["emb.weight", "body.0.weight", "head.bias", "not.a.parameter"]
        batches = _batches(3)
        want = _by_hand(net, batches[:2], names[:3])
        got, seen = local_gradients(net, batches, names, torch.device("cpu"), max_batches=2)
        assert seen == 8 and list(got) == names[:3]
        for n in names[:3]:
            assert torch.equal(got[n], want[n]), (sparse, n)
        assert all(p.grad is None for p in net.parameters())


def test_the_sums_cost_the_same_operators_for_any_number_of_tensors() -> None:
    """Zeroing and adding are one multi-tensor operation each, not one per tensor: a model of 20 layers asks for as
    many operators outside its forward and backward passes as one of 2."""

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def extra(layers: int) -> int:
        net = _Net(False, layers)
        names = [n for n, _ in net.named_parameters()]
        count = Count()
        with count:
            local_gradients(net, _batches(1), names, torch.device("cpu"), max_batches=1)
        return sum(name in ("zeros_like", "zero_", "add_", "_foreach_zero_", "_foreach_add_") for name in count.names)

    assert extra(2) == extra(20) <= 2
