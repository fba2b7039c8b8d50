"""Tests for the backbones in :mod:`pl_fedsparse.models`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.models import CNNFEMNIST, MLP, VGG11GN, LeNetCIFAR, McMahanCNN, ResNet18GN

CIFAR = (3, 32, 32)
MNIST = (1, 28, 28)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (lambda: LeNetCIFAR(num_classes=10), 256_830),
        (lambda: CNNFEMNIST(num_classes=10), 2_171_786),
        (lambda: CNNFEMNIST(num_classes=62), 2_278_334),
        (lambda: McMahanCNN(num_classes=10, in_channels=1, input_size=28), 1_663_370),
        (lambda: McMahanCNN(num_classes=10, in_channels=3, input_size=32), 2_156_490),
        (lambda: MLP(num_classes=10), 199_210),
        (lambda: VGG11GN(num_classes=10), 9_231_114),
        (lambda: ResNet18GN(num_classes=10), 11_173_962),
        (lambda: ResNet18GN(num_classes=100), 11_220_132),
    ],
    ids=[
        "lenet",
        "femnist10",
        "femnist62",
        "mcmahan-mnist",
        "mcmahan-cifar",
        "mlp",
        "vgg11",
        "resnet18-10",
        "resnet18-100",
    ],
)
def test_parameter_counts(factory: Any, expected: int) -> None:
    assert n_params(factory()) == expected


def test_mcmahan_layer_counts() -> None:
    sizes = {name: p.numel() for name, p in McMahanCNN().named_parameters()}
    per_layer = {k.split(".")[0]: 0 for k in sizes}
    for k, v in sizes.items():
        per_layer[k.split(".")[0]] += v
    assert per_layer == {"conv1": 832, "conv2": 51_264, "fc1": 1_606_144, "fc2": 5_130}


MODELS = [
    ("lenet", lambda **kw: LeNetCIFAR(**kw), CIFAR, 10),
    ("femnist", lambda **kw: CNNFEMNIST(**kw), MNIST, 62),
    ("mcmahan-mnist", lambda **kw: McMahanCNN(**kw), MNIST, 10),
    ("mcmahan-cifar", lambda **kw: McMahanCNN(in_channels=3, input_size=32, **kw), CIFAR, 10),
    ("mlp", lambda **kw: MLP(**kw), MNIST, 10),
    ("mlp-cifar", lambda **kw: MLP(in_channels=3, input_size=32, hidden=[64], **kw), CIFAR, 10),
    ("vgg11", lambda **kw: VGG11GN(**kw), CIFAR, 10),
    ("resnet18", lambda **kw: ResNet18GN(**kw), CIFAR, 10),
]


@pytest.mark.parametrize(("name", "factory", "shape", "num_classes"), MODELS, ids=[m[0] for m in MODELS])
def test_forward_shape_and_no_buffers(name: str, factory: Any, shape: tuple[int, ...], num_classes: int) -> None:
    torch.manual_seed(0)
    model = factory(num_classes=num_classes)
    assert list(model.buffers()) == []
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        out = model(torch.randn(2, *shape))
    assert out.shape == (2, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("cls", [VGG11GN, ResNet18GN])
def test_width_mult_quarter(cls: type[nn.Module]) -> None:
    small = cls(num_classes=10, width_mult=0.25)
    assert list(small.buffers()) == []
    assert n_params(small) < n_params(cls(num_classes=10)) / 10
    with torch.no_grad():
        out = small(torch.randn(2, *CIFAR))
    assert out.shape == (2, 10)


def test_width_mult_odd_channels_pick_divisor_groups() -> None:
    model = ResNet18GN(num_classes=10, width_mult=0.375)  # 24/48/96/192 channels
    norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert norms and all(m.num_channels % m.num_groups == 0 and m.num_groups <= 32 for m in norms)
    assert model(torch.randn(1, *CIFAR)).shape == (1, 10)


def test_full_width_uses_32_groups() -> None:
    for model in (VGG11GN(), ResNet18GN()):
        norms = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
        assert norms and all(m.num_groups == 32 for m in norms)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_vgg_init() -> None:
    torch.manual_seed(0)
    model = VGG11GN(width_mult=0.25)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            assert torch.all(m.bias == 0)
        elif isinstance(m, nn.GroupNorm):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)
        elif isinstance(m, nn.Linear):
            assert torch.all(m.bias == 0)
            assert m.weight.std().item() == pytest.approx(0.01, rel=0.2)
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 1


def test_resnet_tensor_names() -> None:
    names = set(ResNet18GN().state_dict())
    for name in (
        "conv1.weight",
        "gn1.weight",
        "layer1.0.conv1.weight",
        "layer3.0.conv2.weight",
        "layer4.1.conv2.weight",
        "layer2.0.shortcut.0.weight",
        "layer2.0.shortcut.1.weight",
        "layer3.0.gn2.bias",
        "linear.weight",
        "linear.bias",
    ):
        assert name in names, name
    assert not any(n.startswith("layer1.0.shortcut") for n in names)
    assert not any(".bias" in n and "conv" in n for n in names)


def test_resnet_other_input_size() -> None:
    model = ResNet18GN(num_classes=5, width_mult=0.25)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 5)


BAD_ARGS = [
    (LeNetCIFAR, {"num_classes": 1}, "num_classes", "1"),
    (CNNFEMNIST, {"num_classes": 1}, "num_classes", "1"),
    (McMahanCNN, {"in_channels": 0}, "in_channels", "0"),
    (MLP, {"num_classes": 1}, "num_classes", "1"),
    (MLP, {"hidden": [200, 0]}, "hidden", "[200, 0]"),
    (MLP, {"in_features": 0}, "in_features", "0"),
    (LeNetCIFAR, {"input_size": 8}, "input_size", "8"),
    (LeNetCIFAR, {"in_channels": 0}, "in_channels", "0"),
    (VGG11GN, {"num_classes": 1}, "num_classes", "1"),
    (VGG11GN, {"width_mult": 0}, "width_mult", "0"),
    (VGG11GN, {"in_channels": 0}, "in_channels", "0"),
    (ResNet18GN, {"num_classes": 1}, "num_classes", "1"),
    (ResNet18GN, {"width_mult": 0}, "width_mult", "0"),
    (ResNet18GN, {"width_mult": -0.5}, "width_mult", "-0.5"),
    (ResNet18GN, {"in_channels": 0}, "in_channels", "0"),
    (ResNet18GN, {"groups": 0}, "groups", "0"),
    (ResNet18GN, {"num_classes": 2.5}, "num_classes", "2.5"),
]


@pytest.mark.parametrize(("cls", "kwargs", "param", "value"), BAD_ARGS)
def test_bad_args_raise_config_error(cls: type[nn.Module], kwargs: dict[str, Any], param: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    message = str(info.value)
    assert f"model.backbone.init_args.{param}" in message
    assert value in message
