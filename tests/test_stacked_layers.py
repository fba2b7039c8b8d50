"""The stacked layers of ``executors.stacked.exact_linear`` under ``vmap`` over clients.

GroupNorm (``_StackedGroupNorm``): one kernel for every client, the clients folded into the channels — each client's
output and gradients the bits of its own ``F.group_norm``, whatever the dtype, shape, thread count, and whether the
input, weights or bias are per client or shared. Convolutions: one client's own kernel each (``per_client``, the
default), or one grouped convolution for all (``grouped_convolutions``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import count_operators

from pl_fedsparse.executors.stacked import exact_linear

_CASES = [  # (clients, batch, channels, spatial, groups)
    (5, 8, 64, (16, 16), 32),
    (3, 1, 6, (5, 5), 2),
    (4, 7, 128, (1, 1), 32),
    (2, 4, 16, (3,), 1),
    (6, 9, 12, (), 4),  # (a [N, C] input: GroupNorm after a linear layer)
    (10, 2, 512, (2, 2), 32),
]


def _alone(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, groups: int,
           go: torch.Tensor) -> list[torch.Tensor]:
    """One client's output and gradients (input, weight, bias) by ``F.group_norm`` itself."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = F.group_norm(leaves[0], groups, leaves[1], leaves[2], 1e-5)
    grads = torch.autograd.grad(y, [t for t in leaves if t is not None], go)
    return [y.detach(), *grads]


def _stacked(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, groups: int, go: torch.Tensor,
             dims: tuple[Any, ...], grouped: bool = False) -> list[torch.Tensor]:
    """Every client's output and gradients under ``vmap`` (``dims``: the clients' dimension of x, w, b, go;
    ``grouped``: as beside grouped convolutions, the outputs left with the clients beside the channels)."""
    def one(xk: torch.Tensor, wk: torch.Tensor | None, bk: torch.Tensor | None, gk: torch.Tensor) -> list[Any]:
        def f(xx: torch.Tensor, ww: torch.Tensor | None, bb: torch.Tensor | None) -> torch.Tensor:
            return F.group_norm(xx, groups, ww, bb, 1e-5)

        argnums = tuple(i for i, t in enumerate((xk, wk, bk)) if t is not None)
        y, vjp = torch.func.vjp(f, xk, wk, bk) if wk is not None else torch.func.vjp(lambda xx: f(xx, None, None), xk)
        grads = vjp(gk)
        return [y, *(grads[i] for i in argnums)]

    with exact_linear(True, grouped_convolutions=grouped):
        return torch.func.vmap(one, in_dims=dims)(x, w, b, go)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("layout", ["per client", "shared weights", "no affine", "clients in dim 1"])
@pytest.mark.parametrize("grouped", [False, True], ids=["beside per-client convolutions", "beside grouped ones"])
def test_each_client_gets_the_bits_of_its_own_group_norm(case: tuple[Any, ...], dtype: torch.dtype,
                                                           layout: str, grouped: bool) -> None:
    _compare(case, dtype, layout, torch.device("cpu"), grouped)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", _CASES)
def test_on_cuda_each_client_gets_the_bits_of_its_own_group_norm(case: tuple[Any, ...], dtype: torch.dtype) -> None:
    """On CUDA too (its GroupNorm kernels reduce each (sample, group) alike whatever the rows beside it)."""
    _compare(case, dtype, "per client", torch.device("cuda"))
    _compare(case, dtype, "per client", torch.device("cuda"), grouped=True)


def _compare(case: tuple[Any, ...], dtype: torch.dtype, layout: str, device: torch.device,
             grouped: bool = False) -> None:
    k, n, c, spatial, groups = case
    g = torch.Generator().manual_seed(k * 100 + c)
    x = (torch.randn(k, n, c, *spatial, generator=g) * 3 + 1).to(device, dtype)
    go = torch.randn(k, n, c, *spatial, generator=g).to(device, dtype)
    w, b = torch.randn(k, c, generator=g).to(device, dtype), torch.randn(k, c, generator=g).to(device, dtype)
    dims: tuple[Any, ...] = (0, 0, 0, 0)
    if layout == "shared weights":
        w, b, dims = w[0], b[0], (0, None, None, 0)
    elif layout == "no affine":
        w = b = None
        dims = (0, None, None, 0)
    elif layout == "clients in dim 1":
        x, go, dims = x.movedim(0, 1).contiguous(), go.movedim(0, 1).contiguous(), (1, 0, 0, 1)
    got = _stacked(x, w, b, groups, go, dims, grouped)
    for i in range(k):
        xi = x.select(dims[0], i)
        gi = go.select(dims[3], i)
        wi = None if w is None else (w[i] if dims[1] == 0 else w)
        bi = None if b is None else (b[i] if dims[2] == 0 else b)
        want = _alone(xi, wi, bi, groups, gi)
        assert len(got) == len(want)
        for j, (s, a) in enumerate(zip(got, want, strict=True)):
            # (a shared weight's gradient under vmap is still per client: each client's own)
            assert torch.equal(s[i], a), (layout, i, ["output", "input", "weight", "bias"][j])


def test_threads_do_not_change_the_bits() -> None:
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(3)
            x, go = torch.randn(4, 16, 64, 8, 8, generator=g), torch.randn(4, 16, 64, 8, 8, generator=g)
            w, b = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
            outs.append(_stacked(x, w, b, 32, go, (0, 0, 0, 0)))
            if threads == 1:
                for i in range(4):
                    want = _alone(x[i], w[i], b[i], 32, go[i])
                    assert all(torch.equal(s[i], a) for s, a in zip(outs[0], want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))
    finally:
        torch.set_num_threads(before)


def test_one_kernel_normalises_every_client() -> None:
    """The forward and backward cost the same operators for 2 clients or 20 (no loop over the clients)."""
    def ops(k: int) -> int:
        x, go = torch.randn(k, 4, 8, 3, 3), torch.randn(k, 4, 8, 3, 3)
        w, b = torch.randn(k, 8), torch.randn(k, 8)
        return count_operators(lambda: _stacked(x, w, b, 4, go, (0, 0, 0, 0)))

    assert ops(2) == ops(20)


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GroupNorm(4, 8)
        self.conv2, self.head = torch.nn.Conv2d(8, 4, 3, stride=2), torch.nn.Linear(4 * 3 * 3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv2(torch.relu(self.norm(self.conv1(x)))).flatten(1))


def _step_gradients(k: int, grouped: bool) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A stacked step's gradients of ``k`` clients (operators counted) and client 0's alone."""
    torch.manual_seed(0)
    net = _ConvNet()
    params = {n: torch.stack([p.detach() + 0.01 * i for i in range(k)]) for n, p in net.named_parameters()}
    x, y = torch.randn(k, 6, 3, 8, 8), torch.randint(0, 5, (k, 6))

    def loss(p: dict[str, torch.Tensor], xx: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(net, p, (xx,)), yy)

    stacked: dict[str, torch.Tensor] = {}
    with exact_linear(True, grouped_convolutions=grouped):
        counted = count_operators(lambda: stacked.update(torch.func.vmap(torch.func.grad(loss))(params, x, y)))
        # (as the executor's gradient check takes it: a linear layer's unbatched backward as the stacked one writes it)
        alone = torch.func.grad(loss)({n: p[0] for n, p in params.items()}, x[0], y[0])
    return counted, {n: g[0] for n, g in stacked.items()}, alone


def test_convolutions_per_client_or_grouped() -> None:
    """Per client: a client's gradients are the bits of its own, at operators that grow with the clients; grouped:
    the same operators for 2 clients or 10 (one convolution a layer), the gradients equal to rounding only."""
    per2, _, _ = _step_gradients(2, grouped=False)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (bits at one thread, as the executor's whole runs are compared: with more, a batched
    try:                      # product and one client's own may split their work differently — seen at two threads
        per10, got, alone = _step_gradients(10, grouped=False)  # on an AVX-512 CPU, in the linear layer's gradient)
    finally:
        torch.set_num_threads(before)
    assert per10 > per2
    assert all(torch.equal(got[n], alone[n]) for n in alone)
    grouped2, _, _ = _step_gradients(2, grouped=True)
    grouped10, got, alone = _step_gradients(10, grouped=True)
    assert grouped2 == grouped10 < per10
    for n in alone:
        torch.testing.assert_close(got[n], alone[n], rtol=1e-5, atol=1e-6)


# ---- under autocast (bf16-mixed): each client's arguments cast as autocast casts its own call's ------------------

def test_autocast_targets_are_asked_of_autocast() -> None:
    """Linear layers and convolutions go to bfloat16 under CPU autocast; GroupNorm keeps its input's dtype there."""
    from pl_fedsparse.executors.stacked import _autocast_target

    assert _autocast_target("linear", "cpu", torch.bfloat16) == torch.bfloat16
    assert _autocast_target("conv2d", "cpu", torch.bfloat16) == torch.bfloat16
    assert _autocast_target("group_norm", "cpu", torch.bfloat16) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_on_cuda_autocast_runs_group_norm_in_float32() -> None:
    from pl_fedsparse.executors.stacked import _autocast_target

    assert _autocast_target("group_norm", "cuda", torch.bfloat16) == torch.float32
    assert _autocast_target("linear", "cuda", torch.bfloat16) == torch.bfloat16


class _Layers(torch.nn.Module):
    """A convolution, GroupNorm, ReLU, max-pooling and a linear head: the papers' models in small."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.GroupNorm(4, 16)
        self.head = torch.nn.Linear(16 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2)
        return self.head(h.flatten(1))


def _autocast_step(device: torch.device, grouped: bool = False,
                   k: int = 4) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], torch.Tensor,
                                        list[torch.Tensor]]:
    """The stacked forward's outputs and gradients under bf16 autocast (as the executor takes them: ``vmap`` of
    ``grad``, the backward outside autocast) and each client's own by autograd (as a Lightning fit takes them)."""
    torch.manual_seed(0)
    net = _Layers().to(device)
    params = {n: torch.stack([p.detach() + 0.01 * i for i in range(k)]) for n, p in net.named_parameters()}
    x, y = torch.randn(k, 6, 3, 8, 8, device=device), torch.randint(0, 5, (k, 6), device=device)

    def forward(p: dict[str, torch.Tensor], xx: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return torch.func.functional_call(net, p, (xx,))

    def loss(p: dict[str, torch.Tensor], xx: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return F.cross_entropy(forward(p, xx), yy)

    with exact_linear(True, grouped_convolutions=grouped):
        grads = torch.func.vmap(torch.func.grad(loss))(params, x, y)
        out = torch.func.vmap(forward)(params, x)
    alone, outs = [], []
    for i in range(k):
        leaves = {n: p[i].clone().requires_grad_() for n, p in params.items()}
        outs.append(forward(leaves, x[i]).detach())
        alone.append(dict(zip(leaves, torch.autograd.grad(loss(leaves, x[i], y[i]), list(leaves.values())),
                              strict=True)))
    return grads, alone, out, outs


def test_under_autocast_each_client_gets_the_bits_of_its_own_layers() -> None:
    """bf16 linear, convolution and GroupNorm (a bfloat16 input with float32 weights): each client's outputs and
    gradients are those of its own autocast call, bit for bit at one thread (``vmap``'s own rules compute the
    stacked layers in another precision: outputs and gradients apart by far more than a last bit)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads, alone, out, outs = _autocast_step(torch.device("cpu"))
    finally:
        torch.set_num_threads(before)
    for i, (a, o) in enumerate(zip(alone, outs, strict=True)):
        assert out.dtype == o.dtype == torch.bfloat16 and torch.equal(out[i], o), i
        for n in a:
            assert torch.equal(grads[n][i], a[n]), (i, n)


def test_under_autocast_grouped_convolutions_stay_close() -> None:
    """``convolutions: grouped`` under autocast: the other layers still each client's own, the convolutions
    bfloat16's rounding apart — logits within a few bfloat16 steps."""
    _, _, out, outs = _autocast_step(torch.device("cpu"), grouped=True)
    for i, o in enumerate(outs):
        assert out.dtype == o.dtype
        torch.testing.assert_close(out[i].float(), o.float(), rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_on_cuda_under_autocast_each_client_gets_its_own_dtypes_and_close_values() -> None:
    """On CUDA (GroupNorm in float32 under autocast there): the stacked outputs and gradients in the dtypes of one
    client's call; values to bfloat16 rounding (the GPU's kernels need not give a batched call the bits of one)."""
    grads, alone, out, outs = _autocast_step(torch.device("cuda"))
    for i, (a, o) in enumerate(zip(alone, outs, strict=True)):
        assert out.dtype == o.dtype
        torch.testing.assert_close(out[i].float(), o.float(), rtol=0.05, atol=0.05)
        for n in a:
            assert grads[n].dtype == a[n].dtype
            torch.testing.assert_close(grads[n][i], a[n], rtol=0.05, atol=0.05 * float(a[n].abs().max()))
