"""The maths of stacked fits: one leading client dimension on every tensor.

* :class:`ElementwiseOptim` — one client's optimizer as element-wise hyper-parameters, and :func:`sgd_step` /
  :func:`adam_step`, ``torch.optim.SGD``'s and ``torch.optim.Adam``'s single-tensor updates applied to stacked
  tensors (each client with its own learning rate and step count);
* :func:`clip_per_client` — each client's total gradient norm clipped, as Lightning clips one model's;
* :func:`exact_linear` — linear, 2-D convolution and GroupNorm layers whose ``vmap`` rule gives every client the
  result of the kernel the client would use alone (so that stacked and one-by-one fits agree to the last bit where
  the arithmetic allows; and ``vmap``'s own GroupNorm backward rule is wrong in some compositions): linear layers
  as one batched product, GroupNorm as one kernel over the clients folded into the channels, convolutions one client
  at a time (or, optionally, one grouped convolution: to rounding); under autocast each with its arguments cast as
  autocast casts one client's call;
* :func:`stacked_gradient_error` — how far stacked gradients are from each client's own (the executor's check).

Used by :class:`~pl_fedsparse.executors.vectorized.VectorizedExecutor`; no Lightning, no executor state.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from pl_fedsparse.functional.transfer import clone_tensors, host_tensor

__all__ = ["STACKED_GRADIENT_TOLERANCE", "ElementwiseOptim", "adam_step", "clip_per_client", "exact_linear", "rows_like",
           "sgd_step", "stacked_gradient_error"]

#: the largest relative difference between a client's stacked gradient and its own that counts as rounding
STACKED_GRADIENT_TOLERANCE = 1e-4


@dataclass
class ElementwiseOptim:
    """One client's optimizer, as element-wise hyper-parameters per trainable parameter name."""

    kind: Literal["sgd", "adam"]
    lr: dict[str, float]
    hyper: dict[str, tuple[Any, ...]]  # name -> the hyper-parameters other than lr
    index: dict[str, int] = field(default_factory=dict)  # name -> its index in torch.optim's state_dict

    def signature(self) -> tuple[Any, ...]:
        return self.kind, tuple(sorted(self.hyper.items()))


def rows_like(live: Tensor, like: Tensor) -> Tensor:
    """``live`` ``[K]`` shaped to broadcast over ``like`` ``[K, ...]``."""
    return live.view(-1, *([1] * (like.dim() - 1)))


def _batched(t: Tensor, d: int | None, n: int) -> Tensor:
    """``t`` with its client dimension (``d``; ``None``: the same for every client) in front, ``n`` clients."""
    return t.movedim(d, 0) if d is not None else t.expand(n, *t.shape)


_LINEAR = torch.nn.functional.linear


class _StackedLinear(torch.autograd.Function):
    """``F.linear`` whose batching rule gives, per client, the bits of the unbatched call.

    One client's ``linear`` is ``addmm(bias, x, Wᵀ)``: the product accumulated onto the bias. ``vmap``'s own rule
    computes ``bmm(x, Wᵀ) + bias``, which rounds differently in the last bit — enough for two runs to drift apart
    over a few hundred SGD steps. ``baddbmm`` accumulates like ``addmm`` (bit-identical per batch on the CPU), and the
    backward is written as the unbatched one (``go @ W``, ``goᵀ @ x``, ``Σ go``), whose batched forms are too.
    """

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        return _LINEAR(x, w, b)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, b = inputs
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx: Any, go: Tensor) -> tuple[Tensor | None, ...]:
        x, w = ctx.saved_tensors
        x2, go2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
        need_x, need_w, need_b = ctx.needs_input_grad  # (the first layer's input needs none: a third less work)
        return ((go2 @ w).reshape(x.shape) if need_x else None, go2.t() @ x2 if need_w else None,
                go2.sum(0) if ctx.has_bias and need_b else None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, w: Tensor, b: Tensor | None
             ) -> tuple[Tensor, int]:
        n = info.batch_size
        x, w = _batched(x, in_dims[0], n), _batched(w, in_dims[1], n)
        x3 = x.reshape(n, -1, x.shape[-1])
        if b is None:
            out = torch.bmm(x3, w.transpose(1, 2))
        else:
            out = torch.baddbmm(_batched(b, in_dims[2], n).unsqueeze(1), x3, w.transpose(1, 2))
        return out.reshape(*x.shape[:-1], w.shape[1]), 0


def _stacked_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    x, w, b = _as_autocast_would("linear", x, w, b)
    return _StackedLinear.apply(x, w, b)


_CONV2D = torch.nn.functional.conv2d


def _pair(v: Any) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(t) for t in v]


def _per_client(n: int, in_dims: Sequence[int | None], args: Sequence[Any]) -> list[list[Any]]:
    """The arguments of each of ``n`` clients: batched tensors sliced along their batch dimension."""
    return [[a.select(d, k) if d is not None and isinstance(a, Tensor) else a for a, d in zip(args, in_dims)]
            for k in range(n)]


def _grads_per_client(grads: Any, n: int, in_dims: Sequence[int | None],
                      args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """A ``vmap`` rule for a function returning three optional gradients: each client's alone, stacked."""
    per = [grads(*a) for a in _per_client(n, in_dims, args)]
    outs = tuple(None if per[0][i] is None else torch.stack([p[i] for p in per]) for i in range(3))
    return outs, tuple(None if o is None else 0 for o in outs)


class _StackedConv2d(torch.autograd.Function):
    """``F.conv2d`` whose batching rule runs each client's own convolution (forward and backward): the same bits
    as one client's, where ``vmap``'s rule (one grouped convolution) rounds differently — and, measured on this
    project's CPU for LeNet-CIFAR's convolutions at 10 clients, a third faster than the grouped convolution."""

    @staticmethod
    def forward(x: Tensor, w: Tensor, b: Tensor | None, stride: Any, padding: Any, dilation: Any,
                groups: int) -> Tensor:
        return _CONV2D(x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, w, b, stride, padding, dilation, groups = inputs
        ctx.save_for_backward(x, w)
        ctx.conf = (b is not None, _pair(stride), _pair(padding), _pair(dilation), int(groups))

    @staticmethod
    def backward(ctx: Any, go: Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        has_bias, stride, padding, dilation, groups = ctx.conf
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], has_bias and ctx.needs_input_grad[2])
        gx, gw, gb = _ConvGrad.apply(go, x, w, has_bias, stride, padding, dilation, groups, need)
        return gx, gw, gb, None, None, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Tensor, int]:
        outs = [_CONV2D(*a) for a in _per_client(info.batch_size, in_dims, args)]
        return torch.stack(outs), 0


class _ConvGrad(torch.autograd.Function):
    """One client's convolution gradients (``aten.convolution_backward``, what autograd runs for ``conv2d``), per
    client under ``vmap``."""

    @staticmethod
    def forward(go: Tensor, x: Tensor, w: Tensor, has_bias: bool, stride: list[int], padding: list[int],
                dilation: list[int], groups: int, need: tuple[bool, bool, bool]) -> tuple[Any, ...]:
        return torch.ops.aten.convolution_backward(go, x, w, [w.shape[0]] if has_bias else None, stride, padding,
                                                   dilation, False, [0, 0], groups, list(need))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return _grads_per_client(_ConvGrad.forward, info.batch_size, in_dims, args)


def _stacked_conv2d(x: Tensor, w: Tensor, b: Tensor | None = None, stride: Any = 1, padding: Any = 0,
                    dilation: Any = 1, groups: int = 1) -> Tensor:
    if isinstance(padding, str):  # "same"/"valid": vmap's own rule
        return _CONV2D(x, w, b, stride, padding, dilation, groups)
    x, w, b = _as_autocast_would("conv2d", x, w, b)
    return _StackedConv2d.apply(x, w, b, stride, padding, dilation, groups)


_GROUP_NORM = torch.nn.functional.group_norm


def _gn_sizes(x: Tensor) -> tuple[int, int, int]:
    n, c = x.shape[0], x.shape[1]
    return n, c, x.numel() // (n * c) if n * c else 0


def _fold(t: Tensor, d: int | None, n: int) -> Tensor:
    """``[K, N, C, ...]`` (client dimension ``d``) as one batch ``[N, K·C, ...]``: every client's channels (or
    groups) side by side, each sample's clients in order (a copy)."""
    t = _batched(t, d, n)
    return t.movedim(0, 1).reshape(t.shape[1], n * t.shape[2], *t.shape[3:]).contiguous()


def _unfold(t: Tensor, n: int, front: bool) -> Tensor:
    """:func:`_fold`'s inverse: ``[N, K·C, ...]`` as ``[K, N, C, ...]`` (``front``: contiguous, a copy — what a
    per-client convolution reads where it lies, where from a strided slice a GPU convolution would copy it first, a
    launch a client) or, without a copy, as ``[N, K, C, ...]`` (the clients in dimension 1: what a grouped
    convolution reads as it is)."""
    t = t.view(t.shape[0], n, t.shape[1] // n, *t.shape[2:])
    return t.movedim(1, 0).contiguous() if front else t


def _fold_rows(t: Tensor | None, d: int | None, n: int) -> Tensor | None:
    """A per-channel ``[K, C]`` affine parameter (client dimension ``d``) as ``[K·C]``, matching :func:`_fold`."""
    return None if t is None else _batched(t, d, n).reshape(-1)


class _StackedGroupNorm(torch.autograd.Function):
    """``F.group_norm`` whose batching rule gives each client the bits of its own (forward and backward).

    ``vmap``'s own rule for the backward (``native_group_norm_backward``) goes wrong where the incoming gradient's
    client dimension is not in front (it reads the gradient before moving that dimension: fixed upstream in
    pytorch/pytorch#176272): measured here for ResNet18-GN, stacked gradients up to 3e-3 off a client's own. This
    rule folds the ``K`` clients into the channels instead — ``[K, N, C, ...]`` as ``[N, K·C, ...]`` with ``K·G``
    groups and the clients' affine parameters side by side — so one kernel normalises every client: each (sample,
    group) is the same elements in the same order as the client's own call, its statistics reduced alike and its
    channels scaled by its own weights (bit-identical on the CPU for every dtype, shape and thread count tested:
    ``tests/test_stacked_layers.py``), where a loop over the clients would launch ``K`` kernels and stack them."""

    @staticmethod
    def forward(x: Tensor, num_groups: int, w: Tensor | None, b: Tensor | None,
                eps: float, front: bool) -> tuple[Tensor, Tensor, Tensor]:
        n, c, hw = _gn_sizes(x)
        return torch.ops.aten.native_group_norm(x.contiguous(), w, b, n, c, hw, num_groups, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, num_groups, w, b, _, front = inputs
        _, mean, rstd = output
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.conf = (int(num_groups), w is not None, b is not None, bool(front))
        ctx.mark_non_differentiable(mean, rstd)

    @staticmethod
    def backward(ctx: Any, go: Tensor, *_: Any) -> tuple[Any, ...]:
        x, w, mean, rstd = ctx.saved_tensors
        groups, has_w, has_b, front = ctx.conf
        need = (ctx.needs_input_grad[0], has_w and ctx.needs_input_grad[2], has_b and ctx.needs_input_grad[3])
        gx, gw, gb = _GroupNormGrad.apply(go, x, mean, rstd, w, groups, need, front)
        return gx, None, gw, gb, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], x: Tensor, num_groups: int, w: Tensor | None,
             b: Tensor | None, eps: float, front: bool) -> tuple[tuple[Tensor, ...], tuple[int, ...]]:
        k = info.batch_size
        xf = _fold(x, in_dims[0], k)
        n, c, hw = _gn_sizes(xf)
        y, mean, rstd = torch.ops.aten.native_group_norm(xf, _fold_rows(w, in_dims[2], k), _fold_rows(b, in_dims[3], k),
                                                         n, c, hw, k * int(num_groups), eps)
        return (_unfold(y, k, front), mean.view(n, k, -1), rstd.view(n, k, -1)), (0 if front else 1, 1, 1)


class _GroupNormGrad(torch.autograd.Function):
    """One client's group-norm gradients (``aten.native_group_norm_backward``, what autograd runs for
    ``group_norm``), per client under ``vmap``."""

    @staticmethod
    def forward(go: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, w: Tensor | None, groups: int,
                need: tuple[bool, bool, bool], front: bool) -> tuple[Any, ...]:
        n, c, hw = _gn_sizes(x)
        return torch.ops.aten.native_group_norm_backward(go.contiguous(), x.contiguous(), mean, rstd, w, n, c, hw,
                                                         groups, list(need))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None, ...], go: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
             w: Tensor | None, groups: int, need: tuple[bool, bool, bool], front: bool
             ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """:class:`_StackedGroupNorm`'s folding: one kernel for every client's gradients, each client's bits."""
        k = info.batch_size
        gof, xf = _fold(go, in_dims[0], k), _fold(x, in_dims[1], k)
        n, c, hw = _gn_sizes(xf)
        # (the statistics [K, N, G] folded as the channels are: [N, K·G])
        mean_f, rstd_f = _fold(mean, in_dims[2], k), _fold(rstd, in_dims[3], k)
        gx, gw, gb = torch.ops.aten.native_group_norm_backward(gof, xf, mean_f, rstd_f, _fold_rows(w, in_dims[4], k),
                                                               n, c, hw, k * int(groups), list(need))
        outs = (None if gx is None else _unfold(gx, k, front), None if gw is None else gw.view(k, -1),
                None if gb is None else gb.view(k, -1))
        return outs, (None if gx is None else 0 if front else 1, None if gw is None else 0, None if gb is None else 0)


def _autocast_state(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs lower-precision operators in on ``device_type`` now, or ``None`` where it is off."""
    try:
        on = torch.is_autocast_enabled(device_type)
        dtype = torch.get_autocast_dtype(device_type)
    except TypeError:  # (torch < 2.4: no device argument)
        cpu = device_type == "cpu"
        on = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    return dtype if on else None


#: each replaced operator on a small input of a dtype, for :func:`_autocast_target` to see what autocast does with it
_PROBES: dict[str, Any] = {
    "linear": lambda t: _LINEAR(t(1, 2), t(1, 2)),
    "conv2d": lambda t: _CONV2D(t(1, 1, 1, 1), t(1, 1, 1, 1)),
    "group_norm": lambda t: _GROUP_NORM(t(1, 1, 2), 1),
}


@functools.cache
def _autocast_target(op: str, device_type: str, autocast_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype autocast casts ``op``'s floating-point arguments to on ``device_type`` (``autocast_dtype``: the
    lower-precision operators, e.g. linear and convolutions; ``float32``: the operators it runs in full precision,
    e.g. GroupNorm on CUDA), or ``None`` (it leaves the arguments as they are: GroupNorm on the CPU). Asked of
    autocast itself, once, on a small input, rather than copied from its lists (which differ by device and
    version)."""
    def probe(dtype: torch.dtype) -> torch.dtype:
        return _PROBES[op](lambda *shape: torch.ones(*shape, dtype=dtype, device=device_type)).dtype

    with torch.autocast(device_type, dtype=autocast_dtype):
        if probe(torch.float32) == autocast_dtype:
            return autocast_dtype
        if probe(autocast_dtype) == torch.float32:
            return torch.float32
    return None


def _as_autocast_would(op: str, x: Tensor, *tensors: Tensor | None) -> tuple[Any, ...]:
    """``op``'s tensor arguments (input ``x``, then the others) cast as autocast casts them where it is on (the
    stacked rules call the kernels below autocast's dispatch): every floating-point one but float64 to
    :func:`_autocast_target`'s dtype — so each client computes in the precision, and with the kernels, of its own
    call."""
    tensors = (x, *tensors)
    autocast = _autocast_state(x.device.type)
    target = None if autocast is None else _autocast_target(op, x.device.type, autocast)
    if target is None:
        return tensors
    return tuple(t.to(target) if t is not None and t.is_floating_point() and t.dtype not in (target, torch.float64)
                 else t for t in tensors)


def _stacked_group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                        eps: float = 1e-5) -> Tensor:
    x, weight, bias = _as_autocast_would("group_norm", x, weight, bias)
    return _StackedGroupNorm.apply(x, num_groups, weight, bias, eps, True)[0]


def _folded_group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                       eps: float = 1e-5) -> Tensor:
    """:func:`_stacked_group_norm` whose outputs keep the clients beside the channels (``[N, K, C, ...]``): what a
    grouped convolution reads without a copy (``convolutions: grouped``)."""
    x, weight, bias = _as_autocast_would("group_norm", x, weight, bias)
    return _StackedGroupNorm.apply(x, num_groups, weight, bias, eps, False)[0]


#: the CUDA back ends whose float32 arithmetic may run in TF32 (10-bit mantissa): cuDNN's convolutions do by
#: default, cuBLAS's matmuls when the user asks (``torch.set_float32_matmul_precision``)
_FP32_BACKENDS = ("cudnn.conv", "cuda.matmul")


def _fp32_setting(backend: str) -> Any:
    """The back end's object holding its float32 precision (``torch.backends.cudnn.conv``, ...; before torch 2.9,
    which has no ``cudnn.conv``, the nearest one that exists: ``torch.backends.cudnn`` and its ``allow_tf32``)."""
    obj: Any = torch.backends
    for part in backend.split("."):
        if not hasattr(obj, part):
            break
        obj = getattr(obj, part)
    return obj


@contextlib.contextmanager
def full_fp32() -> Iterator[None]:
    """Float32 convolutions and matmuls in IEEE float32 on CUDA for the duration (TF32 off), the settings before
    restored after. The gradient check (:func:`stacked_gradient_error`) runs under it: cuDNN convolves in TF32 by
    default, whose rounding (relative 2^-11 per product) puts two kernel choices for the same layer 5e-4 apart
    through VGG11-GN on an H100 — above the tolerance, though no batching rule is wrong. Without CUDA the settings
    change nothing."""
    saved: list[tuple[Any, str, Any]] = []
    try:
        for backend in _FP32_BACKENDS:
            obj = _fp32_setting(backend)
            attr = "fp32_precision" if hasattr(obj, "fp32_precision") else "allow_tf32"  # torch >= 2.9 / before
            saved.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, "ieee" if attr == "fp32_precision" else False)
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


@contextlib.contextmanager
def exact_linear(enabled: bool, *, grouped_convolutions: bool = False) -> Iterator[None]:
    """``torch.nn.functional.linear``, ``conv2d`` and ``group_norm`` are :func:`_stacked_linear`,
    :func:`_stacked_conv2d` and :func:`_stacked_group_norm` for the duration (what ``nn.Linear``, ``nn.Conv2d`` and
    ``nn.GroupNorm`` call). Under autocast (``bf16-mixed``) their arguments are cast as autocast casts the
    operator's (:func:`_as_autocast_would`), so each client still gets the dtype and kernels of its own call.

    Args:
        grouped_convolutions: leave ``conv2d`` to ``vmap``'s own rule — every client's convolution as one grouped
            convolution (one kernel a layer, forward and backward, where :func:`_stacked_conv2d` runs one a client),
            which rounds differently from a client's own convolution."""
    if not enabled:
        yield
        return
    setattr(torch.nn.functional, "linear", _stacked_linear)  # noqa: B010 (a module attribute, on purpose)
    if not grouped_convolutions:
        setattr(torch.nn.functional, "conv2d", _stacked_conv2d)  # noqa: B010
    setattr(torch.nn.functional, "group_norm",  # noqa: B010
            _folded_group_norm if grouped_convolutions else _stacked_group_norm)
    try:
        yield
    finally:
        setattr(torch.nn.functional, "linear", _LINEAR)  # noqa: B010
        setattr(torch.nn.functional, "conv2d", _CONV2D)  # noqa: B010
        setattr(torch.nn.functional, "group_norm", _GROUP_NORM)  # noqa: B010


def stacked_gradient_error(loss: Any, params: dict[str, Tensor], fixed: dict[str, Tensor], xs: Tensor, ys: Tensor,
                           stacked: dict[str, Tensor], clients: int = 4) -> tuple[float, str]:
    """How far the stacked gradients ``stacked`` (of ``torch.func.vmap(grad(loss))`` over the leading client
    dimension) are from each client's gradient computed alone, for the first ``clients`` clients: the largest
    ``max|g_stacked − g_alone| / max|g_alone|`` over parameters, and that parameter's name.

    A ``vmap`` batching rule that disagrees with the unbatched operator shows here: measured on the CPU (torch
    2.14.1) for ResNet18-GN, 9e-4 with every client at the same weights, where VGG11-GN, LeNet-CIFAR and the
    McMahan CNN stay below 3e-6 (rounding)."""
    worst, name = 0.0, ""
    alone = torch.func.grad(loss)
    names, scales, diffs = [], [], []
    for k in range(min(clients, xs.shape[0])):
        g = alone({n: p[k] for n, p in params.items()}, {n: f[k] for n, f in fixed.items()}, xs[k], ys[k])
        for n, t in g.items():
            names.append(n)
            scales.append(t.abs().max().double())
            diffs.append((t - stacked[n][k]).abs().max().double())
    if not names:
        return worst, name
    read = torch.stack([torch.stack(scales), torch.stack(diffs)]).tolist()  # (one read on the host, not two a tensor)
    for n, scale, diff in zip(names, *read, strict=True):
        err = diff / scale if scale > 0 else 0.0
        if err > worst:
            worst, name = err, n
    return worst, name


def clip_per_client(grads: dict[str, Tensor], max_norm: float, without: dict[str, list[bool]] | None = None) -> None:
    """Each client's gradients scaled by ``min(1, max_norm / (‖g‖ + 1e-6))`` over all its tensors, as
    ``torch.nn.utils.clip_grad_norm_`` (Lightning's ``gradient_clip_val``) does for one client.

    Args:
        without: per tensor name, per row, ``True`` where that client has no gradient for the tensor (a frozen
            parameter in process): left out of that client's norm, as ``clip_grad_norm_`` leaves it out — rows with
            the same tensors left out share one reduction (the same bits as the client's own)."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), 2, dim=1) for g in grads.values()], dim=1)
    names = list(grads)
    if not without or not any(any(rows) for rows in without.values()):
        total = torch.linalg.vector_norm(norms, 2, dim=1)
    else:
        k = norms.shape[0]
        patterns: dict[tuple[bool, ...], list[int]] = {}
        for r in range(k):
            patterns.setdefault(tuple(n in without and bool(without[n][r]) for n in names), []).append(r)
        total = torch.empty(k, dtype=norms.dtype, device=norms.device)
        for left_out, rows in patterns.items():
            at = host_tensor(rows, norms.device)
            kept = host_tensor([j for j, out in enumerate(left_out) if not out], norms.device)
            total.index_copy_(0, at, torch.linalg.vector_norm(norms.index_select(0, at).index_select(1, kept), 2,
                                                              dim=1))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(rows_like(coef, g))


def sgd_step(P: dict[str, Tensor], G: dict[str, Tensor], state: dict[str, dict[str, Tensor]], optim: ElementwiseOptim,
             lrs: dict[str, list[float]], steps: dict[str, Tensor] | Tensor) -> None:
    """``torch.optim.SGD``'s update on stacked tensors: weight decay, momentum (the first step takes the gradient as
    the buffer), dampening, Nesterov (``steps``, :func:`adam_step`'s counts, is not read: SGD has none).

    The tensors that share their hyper-parameters, learning rates and momentum state are updated together by
    multi-tensor operations (``torch._foreach_*``: what ``torch.optim.SGD`` does by default on a GPU, a few launches
    for them all; on the CPU the same operations tensor by tensor, so the same numbers as the single-tensor form).
    With a learning rate per row each row takes its own ``add_(g, alpha=-lr)``, as ``torch.optim.SGD`` takes it (a
    product by a tensor of rates would round differently)."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for n, p in P.items():
        rates = tuple(lrs[n])
        lr = rates[0] if all(r == rates[0] for r in rates) else rates
        st = state[n]
        fresh = (n,) if st.get("fresh") is not None else ()  # (rows whose buffer starts now: a tensor on its own)
        key = (optim.hyper[n], lr, st.get("momentum_buffer") is not None, fresh, p.device, p.dtype)
        groups.setdefault(key, []).append(n)
    with torch.no_grad():
        for (hyper, lr, has_buffer, _, _, _), names in groups.items():
            _sgd_group([P[n] for n in names], [G[n] for n in names], [state[n] for n in names], hyper, lr,
                       has_buffer)


def _sgd_group(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]], hyper: tuple[Any, ...],
               lr: float | tuple[float, ...], has_buffer: bool) -> None:
    """:func:`sgd_step` of tensors sharing hyper-parameters, learning rate(s) and momentum state."""
    momentum, dampening, nesterov, wd = hyper
    if wd != 0:
        grads = list(torch._foreach_add(grads, params, alpha=wd))
    if momentum != 0:
        if not has_buffer:
            bufs = clone_tensors(grads)
            for st, b in zip(states, bufs):
                st["momentum_buffer"] = b
        else:
            bufs = [st["momentum_buffer"] for st in states]
            if states[0].get("fresh") is not None:  # (one tensor: its fresh rows take the gradient, the others the
                # usual update)
                for b, g, st in zip(bufs, grads, states):
                    b.copy_(torch.where(rows_like(st["fresh"], b), g, b.mul(momentum).add_(g, alpha=1 - dampening)))
                    st["fresh"].zero_()
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, grads, alpha=1 - dampening)
        grads = list(torch._foreach_add(grads, bufs, alpha=momentum)) if nesterov else bufs
    if not isinstance(lr, tuple):
        torch._foreach_add_(params, grads, alpha=-lr)
        return
    for p, g in zip(params, grads):
        for row, rate in enumerate(lr):
            p[row].add_(g[row], alpha=-rate)


def adam_step(P: dict[str, Tensor], G: dict[str, Tensor], state: dict[str, dict[str, Tensor]], optim: ElementwiseOptim,
              lrs: dict[str, list[float]], steps: dict[str, Tensor] | Tensor) -> None:
    """``torch.optim.Adam``'s update (no AMSGrad) on stacked tensors, with each client's own step count for the bias
    corrections (Kingma & Ba, Algorithm 1).

    As :func:`sgd_step`, the tensors that share their hyper-parameters, learning rate and step count are updated
    together by multi-tensor operations — ``torch.optim.Adam``'s own ``foreach`` form, the same per-element arithmetic
    as its single-tensor form (on the CPU the same operations tensor by tensor, the same bits). Where the rows' step
    counts or learning rates differ, each tensor takes ``torch.optim.Adam``'s host arithmetic per row (Python floats,
    one copy to the device for the group) in its kernels' order of operations.

    Args:
        steps: ``[K]`` int64 on the host: each row's step count *including* this step — one for every tensor, or
            one per tensor by name (``torch.optim.Adam`` counts each parameter's own steps: a parameter frozen for
            some of a fit's steps has fewer)."""
    shared = None if isinstance(steps, dict) else tuple(int(c) for c in steps.tolist())  # (host: no device wait)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for n, p in P.items():
        counts = shared if shared is not None else tuple(int(c) for c in steps[n].tolist())  # type: ignore[index]
        rates = tuple(lrs[n])
        if all(c == counts[0] for c in counts) and all(r == rates[0] for r in rates):
            lr: float | tuple[float, ...] = rates[0]
            count: int | tuple[int, ...] = counts[0]
        else:
            lr, count = rates, counts
        key = (optim.hyper[n], lr, count, "exp_avg" in state[n], p.device, p.dtype)
        groups.setdefault(key, []).append(n)
    with torch.no_grad():
        for (hyper, lr, count, _, _, _), names in groups.items():
            _adam_group([P[n] for n in names], [G[n] for n in names], [state[n] for n in names], hyper, lr, count)


def _adam_group(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]], hyper: tuple[Any, ...],
                lr: float | tuple[float, ...], count: int | tuple[int, ...]) -> None:
    """:func:`adam_step` of tensors sharing hyper-parameters, learning rate(s), step count(s) and whether their moments
    exist (``lr`` and ``count`` both scalars — every row alike — or both per row)."""
    beta1, beta2, eps, wd = hyper
    if wd != 0:
        grads = list(torch._foreach_add(grads, params, alpha=wd))
    if "exp_avg" not in states[0]:
        fresh = [torch.empty_like(p) for p in params] + [torch.empty_like(p) for p in params]
        torch._foreach_zero_(fresh)
        for st, m, v in zip(states, fresh[:len(params)], fresh[len(params):], strict=True):
            st["exp_avg"], st["exp_avg_sq"] = m, v
    exp_avgs = [st["exp_avg"] for st in states]
    exp_avg_sqs = [st["exp_avg_sq"] for st in states]
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    if not isinstance(lr, tuple):  # one step count and one learning rate for every row
        assert isinstance(count, int)
        step = count
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-step_size)
        return
    # torch.optim.Adam's host arithmetic per row (Python floats), then its kernels' order of operations
    assert isinstance(count, tuple)
    bc2 = [(1 - beta2**c) ** 0.5 for c in count]
    neg_step = [-r / (1 - beta1**c) for r, c in zip(lr, count, strict=True)]
    rows = host_tensor([bc2, neg_step], params[0].device, params[0].dtype)  # (one copy for the group)
    for p, exp_avg, exp_avg_sq in zip(params, exp_avgs, exp_avg_sqs, strict=True):
        denom = (exp_avg_sq.sqrt() / rows_like(rows[0], p)).add_(eps)
        p.add_(rows_like(rows[1], p) * exp_avg / denom)  # addcdiv_: self + value * t1 / t2
