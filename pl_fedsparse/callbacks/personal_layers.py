"""Personal and shared layers: FedRep and LG-FedAvg as one callback, :class:`PersonalLayers`.

Both methods split the network into layers every client keeps for itself (never uploaded, never averaged) and
layers the federation shares (averaged by the loop's FedAvg); they differ in which part is personal and in how a
round trains:

* **FedRep** (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized Federated
  Learning", ICML 2021, Alg. 1): the *head* (the last layer) is personal, the *representation* (the body) shared. A
  round's local fit first trains the head for ``head_epochs`` epochs with the body frozen (Alg. 1: τ_h head
  updates), then the body for the remaining epochs with the updated head frozen (the representation updates); only
  the body travels.
* **LG-FedAvg** (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, "Think Locally, Act Globally:
  Federated Learning with Local and Global Representations", 2020, Alg. 1): the opposite split — the lower,
  *local representation* layers are personal, the top *global* layers shared — and all layers train jointly.

What this callback does, per round, for a participant (fits of kind ``"train"``): the server's message loses its
personal tensors (``on_client_message``: only the shared layers are downloaded and counted), the client's personal
tensors are loaded over the start weights, the fit runs (FedRep: the alternating schedule, by ``requires_grad``, so
a frozen part is exactly unchanged — no weight decay, no momentum — and costs no weight gradient), then the personal
tensors go back to the client's state and the upload keeps only the shared ones. The personal model evaluated is
``{shared global layers, the client's personal layers}``. Personal tensors are client state: checkpointed and
restored on resume.

Bytes: only shared tensors travel, up and down. FLOPs: the loop charges every sample a dense forward + backward; in
FedRep's phases a frozen part needs no weight gradient (and nothing below the lowest trainable layer needs an input
gradient), so the difference — measured once per phase with ``torch.utils.flop_counter`` — is refunded.

Which layers (``personal``): a list of parameter-name prefixes of the LightningModule (``backbone.fc3``), or a
preset over the network's *layers* (the modules that own parameters, in registration order): ``"head"`` — the last
``head_layers`` layers (FedRep's default, 1), ``"body"`` — every layer but the last ``head_layers`` (LG-FedAvg's,
2). For pFedGate's LeNet-CIFAR (conv1, conv2, fc1, fc2, fc3) these give the two codes' CIFAR splits: FedRep's
personal ``fc3`` (``lgcollins/FedRep`` ``main_fedrep.py``: ``w_glob_keys`` = conv1, conv2, fc1, fc2), LG-FedAvg's
personal conv1, conv2, fc1 with fc2, fc3 global (``--num_layers_keep 2``; ``papers/pfedgate/baselines.md`` has the
quirk of the LG-FedAvg code itself).

Example (``configs/cifar10_fedrep.yaml``, ``configs/cifar10_lgfedavg.yaml``):
    .. code-block:: yaml

        trainer:
          local_epochs: 11            # FedRep: 10 head epochs, then 1 body epoch
          callbacks:
            - class_path: pl_fedsparse.callbacks.PersonalLayers
              init_args: {mode: fedrep, head_epochs: 10}     # or {mode: lg} (personal: body, head_layers: 2)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.executors.base import load_state
from pl_fedsparse.executors.runner import ignores_batch_outputs

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["PersonalLayers", "layer_names", "personal_tensor_names"]

Mode = Literal["fedrep", "lg"]
#: each mode's paper defaults: (personal preset, head_layers)
DEFAULTS: dict[str, tuple[str, int]] = {"fedrep": ("head", 1), "lg": ("body", 2)}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def layer_names(module: nn.Module) -> list[str]:
    """The network's layers: names of the modules that own parameters themselves, in registration order.

    Example:
        >>> from pl_fedsparse.models import LeNetCIFAR
        >>> layer_names(LeNetCIFAR())
        ['conv1', 'conv2', 'fc1', 'fc2', 'fc3']
    """
    return [name for name, m in module.named_modules() if name and any(True for _ in m.parameters(recurse=False))]


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def personal_tensor_names(module: nn.Module, personal: str | Sequence[str], head_layers: int = 1) -> list[str]:
    """The state-dict entries (parameters and buffers) of ``module`` that are personal, in state-dict order.

    Args:
        module: the network (the LightningModule: names as in its ``state_dict``).
        personal: ``"head"`` (the last ``head_layers`` layers, :func:`layer_names`), ``"body"`` (all other layers)
            or a list of name prefixes (matched at ``.`` boundaries).
        head_layers: how many of the last layers form the head (presets only).

    Raises:
        ConfigError: a prefix matches nothing, or the split leaves no personal or no shared tensor.

    Example:
        >>> from pl_fedsparse.models import LeNetCIFAR
        >>> personal_tensor_names(LeNetCIFAR(), "head")
        ['fc3.weight', 'fc3.bias']
        >>> personal_tensor_names(LeNetCIFAR(), "body", head_layers=2)[::2]
        ['conv1.weight', 'conv2.weight', 'fc1.weight']
    """
    state = module.state_dict()
    if isinstance(personal, str):
        layers = layer_names(module)
        check(head_layers < len(layers), "PersonalLayers.head_layers", head_layers,
              f"fewer than the network's {len(layers)} layers ({', '.join(layers)})")
        head = layers[len(layers) - head_layers:]
        prefixes = head if personal == "head" else layers[:len(layers) - head_layers]
    else:
        prefixes = list(personal)
        for p in prefixes:
            check(any(_matches(n, p) for n in state), "PersonalLayers.personal", p,
                  "a prefix of the model's tensor names (layers: " + ", ".join(layer_names(module)) + ")")
    names = [n for n in state if any(_matches(n, p) for p in prefixes)]
    shared = [n for n, t in state.items() if n not in names and t.is_floating_point()]
    if not names or not shared:
        raise ConfigError(f"PersonalLayers.personal={personal!r} is invalid: expected a split that leaves both "
                          f"personal and shared tensors (got {len(names)} personal, {len(shared)} shared)")
    return names


class PersonalLayers(FederatedCallback):
    """FedRep (``mode: fedrep``) or LG-FedAvg (``mode: lg``): personal layers kept by each client, shared layers
    averaged by FedAvg (see the module docstring). Owns the ``personal_state`` policy.

    Args:
        mode: ``"fedrep"`` (alternating head / body epochs, Collins et al. 2021 Alg. 1) or ``"lg"`` (joint training,
            Liang et al. 2020 Alg. 1).
        personal: ``"head"``, ``"body"`` or a list of tensor-name prefixes (``[backbone.fc3]``); default: the
            mode's paper split (FedRep ``head``, LG-FedAvg ``body``).
        head_layers: layers in the head for the presets (default: FedRep 1 — the classifier; LG-FedAvg 2 — its
            CIFAR code's ``--num_layers_keep 2``).
        head_epochs: FedRep only: the first ``head_epochs`` epochs of a round's fit train the head (body frozen),
            the other ``trainer.local_epochs − head_epochs`` the body (head frozen). Default 10: every script of the
            FedRep code trains the head for ``--local_ep`` − ``--local_rep_ep`` = 10 epochs (the body for 1 or 5).
        personal_lr: FedRep only: the learning rate of the head epochs (pFedGate App. H searches "its learning rate
            for the personalized model"; the FedRep code uses one rate); scaled by the module's per-round decay.
            ``null``: ``model.lr``.
        fedavg_rounds: the first ``fedavg_rounds`` rounds are plain FedAvg of every layer; then every client's
            personal layers start from the global model (LG-FedAvg's code starts from a FedAvg model, ``--load_fed``).
            Default 0.

    Example:
        .. code-block:: yaml

            trainer:
              local_epochs: 11
              callbacks:
                - class_path: pl_fedsparse.callbacks.PersonalLayers
                  init_args: {mode: fedrep, head_epochs: 10}
    """

    #: per-fit state (the fit's context, FedRep's phase, the parameters' flags and learning rates, samples per phase)
    scratch_attributes = ("_ctx", "_samples", "_params", "_flags", "_base_lrs", "_lr_scale", "_phase")

    def __init__(self, *, mode: Mode = "fedrep", personal: str | list[str] | None = None,
                 head_layers: int | None = None, head_epochs: int | None = None, personal_lr: float | None = None,
                 fedavg_rounds: int = 0) -> None:
        name = "PersonalLayers"
        check(mode in DEFAULTS, f"{name}.mode", mode, "'fedrep' (Collins et al. 2021) or 'lg' (Liang et al. 2020)")
        check(personal is None or personal in ("head", "body") or (
            isinstance(personal, (list, tuple)) and len(personal) > 0
            and all(isinstance(p, str) and p.strip(".") for p in personal)),
            f"{name}.personal", personal, "'head', 'body', a non-empty list of tensor-name prefixes, or null")
        check(head_layers is None or (_is_int(head_layers) and head_layers >= 1), f"{name}.head_layers", head_layers,
              "an int >= 1 or null")
        check(head_layers is None or not isinstance(personal, (list, tuple)), f"{name}.head_layers", head_layers,
              "null when personal is a list of prefixes (it sizes the 'head' / 'body' presets)")
        check(head_epochs is None or mode == "fedrep", f"{name}.head_epochs", head_epochs,
              "null with mode: lg (LG-FedAvg trains all layers jointly)")
        check(head_epochs is None or (_is_int(head_epochs) and head_epochs >= 1), f"{name}.head_epochs", head_epochs,
              "an int >= 1 or null")
        check(personal_lr is None or mode == "fedrep", f"{name}.personal_lr", personal_lr,
              "null with mode: lg (LG-FedAvg trains all layers jointly at one rate)")
        check(personal_lr is None or (_num(personal_lr) and personal_lr > 0), f"{name}.personal_lr", personal_lr,
              "a number > 0 or null")
        check(_is_int(fedavg_rounds) and fedavg_rounds >= 0, f"{name}.fedavg_rounds", fedavg_rounds, "an int >= 0")
        preset, layers = DEFAULTS[mode]
        self.mode: Mode = mode
        self.personal: str | list[str] = list(personal) if isinstance(personal, (list, tuple)) else (personal or preset)
        self.head_layers = head_layers if head_layers is not None else layers
        self.head_epochs = (head_epochs if head_epochs is not None else 10) if mode == "fedrep" else 0
        self.personal_lr = None if personal_lr is None else float(personal_lr)
        self.fedavg_rounds = fedavg_rounds
        #: the personal state-dict entries (set when the federation starts)
        self.personal_names: tuple[str, ...] = ()
        self._personal: frozenset[str] = frozenset()
        self._phase_flops: dict[str, float] = {}
        # per fit
        self._ctx: FitContext | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._flags: dict[str, bool] = {}
        self._base_lrs: list[float] = []
        self._lr_scale = 1.0
        self._phase = ""
        self._samples: dict[str, int] = {}

    # ---- set-up -----------------------------------------------------------------------------------------------
    @override
    def setup_federation(self, loop: FederationView) -> None:
        model = loop.model
        assert model is not None
        self.personal_names = tuple(personal_tensor_names(model, self.personal, self.head_layers))
        self._personal = frozenset(self.personal_names)
        check(self.fedavg_rounds < loop.num_rounds, "PersonalLayers.fedavg_rounds", self.fedavg_rounds,
              f"fewer than trainer.num_rounds={loop.num_rounds}")
        if self.mode == "fedrep":
            check(loop.local_steps is None, "trainer.local_steps", loop.local_steps,
                  "null with PersonalLayers(mode: fedrep): its head / body phases are whole epochs")
            check(self.head_epochs < loop.local_epochs, "PersonalLayers.head_epochs", self.head_epochs,
                  f"fewer than trainer.local_epochs={loop.local_epochs}: FedRep trains the head for head_epochs "
                  "epochs, then the body for the rest of the fit (e.g. local_epochs: 11, head_epochs: 10)")
            check(self.personal_lr is None or _num(getattr(model, "lr", None)), "PersonalLayers.personal_lr",
                  self.personal_lr, "null with a module that has no 'lr' (FederatedModule has one)")
            trainable = {n for n, _ in model.named_parameters()}
            head = {n for n in trainable if n in self._personal}
            x = loop.datamodule.example_input(2)
            self._phase_flops = {"head": _train_flops(model, x, head), "body": _train_flops(model, x, trainable - head)}
        personal = self.personal_names
        self.add_client_state(loop, "weights", lambda k: {n: loop.initial_state[n] for n in personal})

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for PersonalLayers: expected a server (Star); the shared "
                              "layers are averaged by the server")

    def split_active(self, round_idx: int) -> bool:
        """Whether ``round_idx`` keeps the personal layers apart (not one of the ``fedavg_rounds``)."""
        return round_idx >= self.fedavg_rounds

    # ---- policies ---------------------------------------------------------------------------------------------
    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        glob = loop.global_state
        if glob is None:
            raise ConfigError("trainer.topology is invalid for PersonalLayers: expected a server (Star)")
        if not self.split_active(loop.round_idx):
            return dict(glob)  # FedAvg rounds: everyone's model is the global one
        return {**glob, **self.get_client_state(loop, client_idx, "weights")}

    # ---- messages ---------------------------------------------------------------------------------------------
    def _strip(self, message: Message) -> Message:
        keep = self._personal
        return Message({n: t for n, t in message.tensors.items() if n not in keep},
                       {n: m for n, m in message.masks.items() if n not in keep},
                       frozenset(n for n in message.ternary if n not in keep))

    @override
    def on_client_message(self, loop: FederationView, client_idx: int, message: Message) -> None:
        if self.split_active(loop.round_idx):  # only the shared layers are downloaded
            stripped = self._strip(message)
            message.tensors, message.masks, message.ternary = stripped.tensors, stripped.masks, stripped.ternary

    # ---- a local fit ------------------------------------------------------------------------------------------
    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        self._restore()
        active = context.kind == "train" and self.split_active(context.round_idx)
        self._ctx = context if active else None
        self._samples = {}
        if self._ctx is not None:  # the client's own layers over the downloaded shared ones
            load_state(module, self.get_client_state(loop, context.client_idx, "weights"))

    @override
    def vectorized_fit(self) -> Any:
        """LG-FedAvg does nothing inside a fit (all layers train jointly; the personal layers are loaded and kept by
        the federation hooks, which run per client there too): ``None``, its fits stack as they are. FedRep's
        alternating head / body epochs: :class:`~pl_fedsparse.callbacks.personal_layers_stacked.StackedFedRep` (a
        part frozen per client and step; SGD or Adam)."""
        if self.mode == "lg":
            return None
        from pl_fedsparse.callbacks.personal_layers_stacked import StackedFedRep

        return StackedFedRep(self)

    def _fedrep_fit(self) -> bool:
        return self._ctx is not None and self.mode == "fedrep"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._fedrep_fit():
            return
        self._params = dict(pl_module.named_parameters())
        self._flags = {n: p.requires_grad for n, p in self._params.items()}
        opt = trainer.optimizers[0]
        self._base_lrs = [float(g["lr"]) for g in opt.param_groups]
        self._lr_scale = 1.0 if self.personal_lr is None else self.personal_lr / float(pl_module.lr)  # type: ignore[arg-type]

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._fedrep_fit():
            return
        # Alg. 1: τ_h head epochs with the representation fixed, then the representation with the new head fixed
        self._phase = "head" if trainer.current_epoch < self.head_epochs else "body"
        train_head = self._phase == "head"
        for n, p in self._params.items():
            p.requires_grad_(self._flags[n] and ((n in self._personal) == train_head))
        scale = self._lr_scale if train_head else 1.0
        for g, base in zip(trainer.optimizers[0].param_groups, self._base_lrs):
            g["lr"] = base * scale

    @override
    @ignores_batch_outputs
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._fedrep_fit():
            self._samples[self._phase] = self._samples.get(self._phase, 0) + int(batch[1].shape[0])

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for n, p in self._params.items():
            p.requires_grad_(self._flags[n])
        self._params, self._flags = {}, {}

    #: ``on_client_fit_end`` takes the update where the weights are: the personal layers are stored from where the
    #: update is
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        self._restore()
        ctx, self._ctx = self._ctx, None
        samples, self._samples = self._samples, {}
        if ctx is None:
            return
        k = update.client_idx
        self.set_client_state(loop, k, "weights", {n: update.state[n] for n in self.personal_names})
        if update.message is not None:  # only the shared layers are uploaded
            update.message = self._strip(update.message)
        full = loop.accounting.flops_per_sample()
        if samples and not update.masks and full > 0:
            # the loop charges a dense forward + backward per sample; a frozen part needs no weight gradient
            refund = sum(n * (full - self._phase_flops[phase]) for phase, n in samples.items())
            loop.accounting.charge_flops(k, -refund, update)

    # ---- FedAvg rounds (fedavg_rounds > 0) ----------------------------------------------------------------------
    @override
    def on_after_aggregate(self, loop: FederationView) -> None:
        if self.fedavg_rounds and loop.round_idx == self.fedavg_rounds - 1 and loop.global_state is not None:
            start = {n: loop.global_state[n] for n in self.personal_names}  # the same tensors for every client
            for k in range(loop.num_clients):
                self.set_client_state(loop, k, "weights", start)


def _train_flops(module: nn.Module, example: Tensor, trainable: set[str]) -> float:
    """Forward + backward FLOPs per sample when only the parameters named in ``trainable`` need gradients (the
    measurement of :class:`~pl_fedsparse.metrics.TrainFlops`, with the others frozen)."""
    params = dict(module.named_parameters())
    saved = {n: (p.requires_grad, p.grad) for n, p in params.items()}
    was_training = module.training
    module.train()
    try:
        for n, p in params.items():
            p.requires_grad_(n in trainable)
            p.grad = None
        device = next(iter(params.values())).device
        with FlopCounterMode(display=False) as counter:
            out = module(example.to(device))
            loss = out.float().sum()
            if loss.requires_grad:
                loss.backward()
    finally:
        for n, p in params.items():
            p.requires_grad_(saved[n][0])
            p.grad = saved[n][1]
        module.train(was_training)
    return counter.get_total_flops() / int(example.shape[0])
