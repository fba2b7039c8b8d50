"""One persistent fit loop per worker: a client's local fit without building a Lightning ``Trainer``.

A federation runs thousands of short fits (a few hundred samples each). Lightning's ``Trainer`` costs several
milliseconds to build, connect and tear down per fit (and on a GPU its teardown empties the allocator cache and
moves the module back to the host), which is most of a small model's fit. :class:`FitRunner` lives as long as its
executor and drives the user's ``LightningModule`` through the same sequence of hooks as ``Trainer.fit`` with
automatic optimisation does, so that the module, the callbacks and the numbers are those of the reference path
(``trainer.fit_runner: trainer``), bit for bit on the CPU (``tests/test_fit_runner.py`` compares hook sequences,
weights and optimizer state; ``benchmarks/parity.py`` every shipped synthetic config):

* hooks, callbacks then module, in Lightning's order: ``setup``, ``configure_optimizers``, ``on_fit_start``,
  ``on_train_start``; per epoch ``on_train_epoch_start``; per batch ``on_train_batch_start`` (``-1`` from the
  module's ends the epoch), ``training_step`` (under the precision's autocast), ``on_before_zero_grad``,
  ``optimizer.zero_grad()``, ``on_before_backward``, backward, ``on_after_backward``, ``on_before_optimizer_step``
  (gradients unscaled under ``16-mixed``), gradient clipping by norm (``trainer.gradient_clip_val``),
  ``optimizer.step()``, the learning-rate schedulers due (``interval: step``; ``interval: epoch`` after the epoch's
  last batch), ``on_train_batch_end``; ``on_train_epoch_end``; ``on_train_end``, ``on_fit_end``, ``teardown``;
  ``on_exception`` when the fit raises;
* limits as the loop sets them: ``local_epochs`` epochs, or ``local_steps`` optimizer steps over as many epochs as
  it takes (each a new pass over the loader, ``set_epoch`` called on its sampler as Lightning does);
* precision from Lightning Fabric's own plugins (``32-true``, ``bf16-mixed``, ``16-mixed`` with its gradient
  scaler);
* ``self.log`` works (values kept in :attr:`FitTrainer.callback_metrics`), ``self.trainer`` / the callbacks'
  ``trainer`` argument is a :class:`FitTrainer` with what a fit's hooks read (``optimizers``, ``current_epoch``,
  ``global_step``, ``max_epochs``, ``max_steps``, ``should_stop``, ``lr_scheduler_configs``, ``strategy.
  precision_plugin``, ``precision``, ``lightning_module``, ``callbacks``, ...). Anything else raises an
  ``AttributeError`` that names the attribute and the way back to the reference path.

Only what is cheap happens per step: each hook is called only on the callbacks that override it (resolved once per
fit), a batch already on the module's device is not copied, and the step's loss is copied for ``on_train_batch_end``
(``outputs["loss"]``, a detached copy as Lightning gives it) only where a hook there may read it — not for hooks
marked :func:`ignores_batch_outputs` (on a GPU a kernel launch a step). The module stays on its device between fits.

The runner applies to modules with automatic optimisation that leave Lightning's optimiser, backward, batch-transfer
and callback-configuration hooks alone, and to ``configure_optimizers`` results with one optimizer and schedulers
without a ``monitor``; :func:`runner_support` says why not otherwise, and the executor then uses the ``Trainer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from torch import Tensor
from torch.utils._pytree import tree_leaves

from pl_fedsparse.errors import ConfigError, UserCodeError
from pl_fedsparse.functional import transfer

__all__ = ["FIT_RUNNERS", "FitRunner", "FitTrainer", "RunnerUnsupported", "ignores_batch_outputs", "no_optimizer",
           "runner_support"]

#: ``trainer.fit_runner``: ``auto`` (the persistent runner where it applies, else a ``Trainer`` per fit), ``fast``
#: (the runner, a one-line error where it does not apply), ``trainer`` (a ``Trainer`` per fit: the reference)
FIT_RUNNERS = ("auto", "fast", "trainer")

#: the callback hooks a fit calls, in no particular order (all of Lightning's that fire in a fit without validation)
_CALLBACK_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad", "on_exception",
)
#: module hooks the runner calls (when overridden)
_MODULE_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)
#: module hooks whose override makes the runner step aside (it would have to reproduce their Trainer-side defaults)
_UNSUPPORTED_MODULE_HOOKS = (
    "optimizer_step", "optimizer_zero_grad", "backward", "configure_gradient_clipping", "lr_scheduler_step",
    "configure_callbacks", "configure_model", "configure_sharded_model", "on_before_batch_transfer",
    "transfer_batch_to_device", "on_after_batch_transfer",
)


def ignores_batch_outputs(hook: Any) -> Any:
    """Mark a callback's ``on_train_batch_end`` that never reads its ``outputs``: where every such hook of a fit is
    marked (and the module does not override it), the persistent runner hands them the step's loss without the copy
    Lightning makes of it. An override in a subclass is not marked unless it says so too.

    Example:
        >>> class Counter(pl.Callback):
        ...     @ignores_batch_outputs
        ...     def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ...         self.n = getattr(self, "n", 0) + 1
        >>> Counter.on_train_batch_end.ignores_batch_outputs
        True
    """
    hook.ignores_batch_outputs = True
    return hook


def _reads_outputs(hooks: Mapping[str, list[Any]], mod: Mapping[str, Any]) -> bool:
    """Whether a hook of the fit may read ``on_train_batch_end``'s ``outputs``: the module's, or a callback's not
    marked :func:`ignores_batch_outputs`."""
    return "on_train_batch_end" in mod or not all(
        getattr(getattr(fn, "__func__", fn), "ignores_batch_outputs", False) for fn in hooks["on_train_batch_end"])


class RunnerUnsupported(Exception):
    """The persistent runner cannot run this fit as ``Trainer.fit`` would; the message says why."""


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)


def runner_support(module: pl.LightningModule, callbacks: Sequence[Any] = ()) -> str | None:
    """``None`` when :class:`FitRunner` can fit ``module`` with ``callbacks`` as ``Trainer.fit`` would, else why not.

    Example:
        >>> class Manual(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.automatic_optimization = False
        >>> runner_support(Manual())
        'Manual uses manual optimization'
    """
    name = type(module).__name__
    if not module.automatic_optimization:
        return f"{name} uses manual optimization"
    for hook in _UNSUPPORTED_MODULE_HOOKS:
        if hasattr(pl.LightningModule, hook) and _overrides(module, pl.LightningModule, hook):
            return f"{name} overrides {hook}"
    for cb in callbacks:
        if not isinstance(cb, pl.Callback):
            return f"{type(cb).__name__} is not a lightning Callback"
    return None


class FitTrainer:
    """What a fit's hooks see as ``trainer`` (and the module as ``self.trainer``) on the persistent runner.

    Attributes mirror ``lightning.Trainer``'s of the same name during a fit. Reading one it does not have raises an
    ``AttributeError`` naming the attribute and ``trainer.fit_runner: trainer`` (the reference path, a real
    ``Trainer``)."""

    #: (read by the module's ``self.log`` through Lightning's Fabric path: no logger on a client fit)
    logger = None
    loggers: list[Any] = []
    global_rank = local_rank = node_rank = 0
    world_size = num_nodes = num_devices = 1
    is_global_zero = True
    training = True
    sanity_checking = validating = testing = predicting = False
    accumulate_grad_batches = 1
    gradient_clip_algorithm = "norm"
    num_sanity_val_steps = 0
    limit_val_batches = 0
    fast_dev_run = False

    def __init__(self, runner: FitRunner) -> None:
        self._runner = runner
        self.strategy = SimpleNamespace(precision_plugin=None, root_device=runner.device, lightning_module=None)
        self.precision = runner.precision
        self.gradient_clip_val = runner.gradient_clip_val
        self.reset(None, [], -1, -1, None)

    def reset(self, module: pl.LightningModule | None, callbacks: list[Any], max_epochs: int, max_steps: int,
              loader: Any) -> None:
        """Fresh per-fit state (as a new ``Trainer`` would have)."""
        self.lightning_module = self.model = module
        self.strategy.lightning_module = module
        self.callbacks = callbacks
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.train_dataloader = loader
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[Any] = []
        self.current_epoch = 0
        self.global_step = 0
        self.should_stop = False
        self.callback_metrics: dict[str, Any] = {}
        self.num_training_batches = _sized_len(loader)
        #: as ``Trainer(limit_train_batches=...)``, settable by a hook before training starts (``setup``): an int
        #: caps the batches of every epoch, a float in ``[0, 1]`` is a share of them; 0 skips training
        self.limit_train_batches: int | float = 1.0

    @property
    def device(self) -> torch.device:
        return self._runner.device

    @property
    def lr_schedulers(self) -> list[Any]:
        return [c.scheduler for c in self.lr_scheduler_configs]

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """The module's ``self.log`` / ``self.log_dict`` (Lightning's Fabric path): the last value of each name,
        as given (no host sync)."""
        self.callback_metrics.update(metrics)

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        raise AttributeError(
            f"trainer.{item} is not available on the persistent fit runner (trainer.fit_runner); "
            "run with --trainer.fit_runner trainer for a full lightning.Trainer per fit")


def _sized_len(loader: Any) -> float:
    try:
        return float(len(loader))
    except TypeError:
        return math.inf


def _set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Lightning's ``_set_sampler_epoch``: ``set_epoch`` on the loader's sampler and batch sampler's sampler."""
    objects: dict[int, Any] = {}
    sampler = getattr(loader, "sampler", None)
    if sampler is not None:
        objects[id(sampler)] = sampler
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else None
    if inner is not None:
        objects[id(inner)] = inner
    for obj in objects.values():
        set_epoch = getattr(obj, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def no_optimizer(module: pl.LightningModule) -> UserCodeError:
    """The error of a fit whose ``configure_optimizers`` returned ``None`` under automatic optimisation: Lightning
    would train with no optimizer (a warning), so the client would upload its start weights unchanged, silently."""
    return UserCodeError(f"{type(module).__qualname__}.configure_optimizers() returned no optimizer: a local fit "
                         "needs one (return an optimizer, e.g. torch.optim.SGD(self.parameters(), lr=0.1); with "
                         "automatic_optimization = False, step your own)")


class _RequireOptimizer(pl.Callback):
    """On a ``Trainer`` fit: :func:`no_optimizer` where ``configure_optimizers`` returned ``None`` (what the fit
    runner checks itself)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning.pytorch.core.optimizer import _MockOptimizer

        if pl_module.automatic_optimization and all(isinstance(o, _MockOptimizer) for o in trainer.optimizers):
            raise no_optimizer(pl_module)


def _optimizers(module: pl.LightningModule) -> tuple[list[torch.optim.Optimizer], list[Any]]:
    """``configure_optimizers`` parsed as ``Trainer.fit`` parses it (Lightning's own helpers)."""
    from lightning.pytorch.core.optimizer import (
        _configure_optimizers,
        _configure_schedulers_automatic_opt,
        _MockOptimizer,
        _validate_optimizers_attached,
        _validate_scheduler_api,
    )

    conf: Any = module.configure_optimizers()  # (the user's: whatever it returns, Lightning's parser checks it)
    if conf is None:
        if module.automatic_optimization:
            raise no_optimizer(module)
        conf = _MockOptimizer()
    if isinstance(conf, torch.optim.Optimizer):  # the common case, as Lightning parses it (its parser's protocol
        return [conf], []  # check alone costs about a tenth of a millisecond per fit)
    optimizers, schedulers, monitor = _configure_optimizers(conf)
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    if len(optimizers) != 1:
        raise RunnerUnsupported(f"configure_optimizers returned {len(optimizers)} optimizers")
    _validate_optimizers_attached(optimizers, configs)
    _validate_scheduler_api(configs, module)
    for c in configs:
        if c.reduce_on_plateau or c.monitor is not None:
            raise RunnerUnsupported("a learning-rate scheduler monitors a metric")
        if c.interval not in ("step", "epoch"):
            raise RunnerUnsupported(f"a learning-rate scheduler has interval {c.interval!r}")
    return optimizers, configs


class FitRunner:
    """Runs local fits of a ``LightningModule`` as ``Trainer.fit`` would (see the module docstring), reusing itself
    for every fit of its worker.

    Args:
        device: where the module trains (the loop's device).
        precision: ``32-true`` (or ``32``), ``bf16-mixed``, ``16-mixed``.
        gradient_clip_val: clip each step's gradients to this total norm (``None``: no clipping).
    """

    def __init__(self, device: torch.device, precision: str = "32-true",
                 gradient_clip_val: float | None = None) -> None:
        self.device = torch.device(device)
        self.precision = precision
        self.gradient_clip_val = gradient_clip_val
        self.trainer = FitTrainer(self)
        #: of the last fit: optimisation steps run, and how many of them had no loss (``training_step`` -> None)
        self.steps_run = 0
        self.steps_without_loss = 0

    def _plugin(self) -> FabricPrecision:
        """Fabric's precision plugin for this fit (a fresh gradient scaler per fit under ``16-mixed``, as a fresh
        ``Trainer`` has)."""
        if self.precision in ("bf16-mixed", "16-mixed"):
            return FabricMixedPrecision(self.precision, device=self.device.type)  # type: ignore[arg-type]
        if self.precision in ("32-true", "32", 32):
            return FabricPrecision()
        raise RunnerUnsupported(f"precision {self.precision!r}")

    @staticmethod
    def _callback_hooks(callbacks: Sequence[Any]) -> dict[str, list[Any]]:
        """Per hook, the bound methods of the callbacks that override it, in order (once per fit: the steps then
        call only those)."""
        return {h: [getattr(cb, h) for cb in callbacks if _overrides(cb, pl.Callback, h)] for h in _CALLBACK_HOOKS}

    def fit(self, module: pl.LightningModule, loader: Any, callbacks: Sequence[Any], *, max_epochs: int,
            max_steps: int) -> None:
        """One local fit: ``max_epochs`` epochs (``-1``: unbounded) or ``max_steps`` optimizer steps (``-1``:
        unbounded) over ``loader``, as ``Trainer.fit(module, train_dataloaders=loader)`` with those limits.

        Raises:
            RunnerUnsupported: before anything ran (``configure_optimizers`` aside), when this fit needs a
                ``Trainer``.
        """
        why = runner_support(module, callbacks)
        if why is not None:
            raise RunnerUnsupported(why)
        trainer = self.trainer
        self.steps_run = self.steps_without_loss = 0
        cbs = list(callbacks)
        trainer.reset(module, cbs, max_epochs, max_steps, loader)
        plugin = self._plugin()
        trainer.strategy.precision_plugin = plugin
        hooks = self._callback_hooks(cbs)
        mod = {h: getattr(module, h) for h in _MODULE_HOOKS if _overrides(module, pl.LightningModule, h)}
        saved = module._trainer, module._fabric
        # self.log goes through Lightning's Fabric path to FitTrainer.log_dict; self.trainer is FitTrainer (through
        # Lightning's shim); current_epoch / global_step read it too
        module._fabric = trainer  # type: ignore[assignment]
        module._trainer = trainer  # type: ignore[assignment]
        had_log = "log" in vars(module)
        own_log = vars(module).get("log")
        object.__setattr__(module, "log", _last_value_log(module, trainer))  # (self.log's flags checked: see there)
        try:
            if module.device != self.device:
                module.to(self.device)
            torch.set_grad_enabled(True)  # (Lightning 2.x leaves the module's train/eval mode as it finds it)
            self._call(hooks, mod, "setup", module, stage="fit")
            trainer.optimizers, trainer.lr_scheduler_configs = _optimizers(module)
            try:
                self._run(module, loader, trainer, plugin, hooks, mod)
            except BaseException as e:
                for fn in hooks["on_exception"]:
                    fn(trainer, module, e)
                raise
        finally:
            module._trainer, module._fabric = saved
            if had_log:
                object.__setattr__(module, "log", own_log)
            else:
                vars(module).pop("log", None)

    @staticmethod
    def _call(hooks: Mapping[str, list[Any]], mod: Mapping[str, Any], name: str, module: pl.LightningModule,
              *args: Any, **kwargs: Any) -> Any:
        trainer = module._trainer
        for fn in hooks[name]:
            fn(trainer, module, *args, **kwargs)
        fn = mod.get(name)
        return fn(*args, **kwargs) if fn is not None else None

    def _run(self, module: pl.LightningModule, loader: Any, trainer: FitTrainer, plugin: FabricPrecision,
             hooks: Mapping[str, list[Any]], mod: Mapping[str, Any]) -> None:
        call = self._call
        optimizer = trainer.optimizers[0]
        scaler = getattr(plugin, "scaler", None)
        clip = self.gradient_clip_val
        params = [p for group in optimizer.param_groups for p in group["params"]] if clip else []
        step_scheds = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
        epoch_scheds = [c for c in trainer.lr_scheduler_configs if c.interval == "epoch"]
        limit = trainer.limit_train_batches
        if isinstance(limit, float) and not (0.0 <= limit <= 1.0) or isinstance(limit, int) and limit < 0:
            raise RunnerUnsupported(f"limit_train_batches={limit!r}")
        if isinstance(limit, int) and not isinstance(limit, bool):
            trainer.num_training_batches = min(trainer.num_training_batches, limit)
        elif limit != 1.0:
            trainer.num_training_batches = float(int(trainer.num_training_batches * limit))
        n_batches = trainer.num_training_batches
        device = self.device
        copy_loss = _reads_outputs(hooks, mod)
        call(hooks, mod, "on_fit_start", module)
        module.zero_grad()
        if n_batches == 0:  # Lightning's fit loop skips: no train start, epoch or end hooks
            call(hooks, mod, "on_fit_end", module)
            call(hooks, mod, "teardown", module, stage="fit")
            return
        call(hooks, mod, "on_train_start", module)
        max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
        epoch, stop = 0, False
        while not stop and (max_epochs < 0 or epoch < max_epochs) and not trainer.should_stop:
            trainer.current_epoch = epoch
            _set_sampler_epoch(loader, epoch)
            call(hooks, mod, "on_train_epoch_start", module)
            batch_idx = -1
            for batch_idx, batch in enumerate(loader):
                batch = _to_device(batch, device)
                skip_rest = call(hooks, mod, "on_train_batch_start", module, batch, batch_idx) == -1
                outputs: Any = None
                if not skip_rest:
                    outputs = self._step(module, optimizer, plugin, scaler, params, batch, batch_idx, hooks, mod,
                                         copy_loss)
                    trainer.global_step += 1
                    self.steps_run += 1
                    self.steps_without_loss += outputs.get("loss") is None
                for c in step_scheds:
                    if (batch_idx + 1) % c.frequency == 0:
                        c.scheduler.step()
                if batch_idx + 1 >= n_batches or skip_rest:
                    for c in epoch_scheds:
                        if (epoch + 1) % c.frequency == 0:
                            c.scheduler.step()
                if skip_rest:
                    break
                call(hooks, mod, "on_train_batch_end", module, outputs, batch, batch_idx)
                if 0 <= max_steps <= trainer.global_step:
                    stop = True
                    break
                if trainer.should_stop or batch_idx + 1 >= n_batches:  # (a limit_train_batches below the length)
                    break
            if batch_idx < 0 and max_epochs < 0:
                stop = True  # an empty loader under a step limit: Lightning runs no step either
            call(hooks, mod, "on_train_epoch_end", module)
            epoch += 1
        trainer.current_epoch = epoch
        call(hooks, mod, "on_train_end", module)
        call(hooks, mod, "on_fit_end", module)
        call(hooks, mod, "teardown", module, stage="fit")

    @staticmethod
    def _step(module: pl.LightningModule, optimizer: torch.optim.Optimizer, plugin: FabricPrecision, scaler: Any,
              params: list[Tensor], batch: Any, batch_idx: int, hooks: Mapping[str, list[Any]],
              mod: Mapping[str, Any], copy_loss: bool = True) -> dict[str, Any]:
        """One automatic-optimisation step, in ``Trainer.fit``'s order; returns what ``on_train_batch_end`` gets
        (the loss detached, copied where ``copy_loss``)."""
        call = FitRunner._call
        with plugin.forward_context():
            out = module.training_step(batch, batch_idx)
        if isinstance(out, Tensor) or out is None:
            loss, extra = out, {}
        elif isinstance(out, Mapping) and isinstance(out.get("loss"), Tensor):
            loss = out["loss"]
            extra = {k: v for k, v in out.items() if k != "loss"}
        else:
            raise training_step_output_error(module, out)
        call(hooks, mod, "on_before_zero_grad", module, optimizer)
        optimizer.zero_grad()
        if loss is not None:
            scaled = scaler.scale(loss) if scaler is not None else loss
            call(hooks, mod, "on_before_backward", module, scaled)
            scaled.backward()
            call(hooks, mod, "on_after_backward", module)
            if scaler is not None:
                scaler.unscale_(optimizer)
        call(hooks, mod, "on_before_optimizer_step", module, optimizer)
        if params:  # (params only with a clip value, which the fit's FitTrainer holds: a float)
            trainer: Any = module._trainer
            torch.nn.utils.clip_grad_norm_(params, trainer.gradient_clip_val)
        if scaler is not None:
            if loss is not None:
                scaler.step(optimizer)
                scaler.update()
        else:
            optimizer.step()
        if loss is None:
            return {"loss": None, **extra}
        return {"loss": loss.detach().clone() if copy_loss else loss.detach(), **extra}


def _last_value_log(module: pl.LightningModule, trainer: FitTrainer) -> Any:
    """``module.log`` during a fit on the runner: Lightning's own, which keeps the last value of each name
    (:meth:`FitTrainer.log_dict`) — what ``Trainer.fit`` keeps for a ``training_step`` log with its default
    ``on_step=True``. An epoch reduction (``on_epoch=True`` on a name logged more than once in an epoch, or
    forked into ``_step``/``_epoch`` names) is not made here: it is refused in one line, naming the way to the
    ``Trainer`` that makes it, rather than recorded as another number."""
    real = type(module).log.__get__(module)
    epochs: dict[str, int] = {}

    def log(name: str, value: Any, prog_bar: bool = False, logger: bool | None = None, on_step: bool | None = None,
            on_epoch: bool | None = None, *args: Any, **kwargs: Any) -> None:
        if on_epoch:
            again = epochs.get(name) == trainer.current_epoch
            epochs[name] = trainer.current_epoch
            if again or on_step:
                flags = "on_epoch=True and on_step=True" if on_step else "on_epoch=True"
                raise ConfigError(
                    f"{type(module).__qualname__} logged {name!r} with {flags}: the persistent fit runner keeps each "
                    "name's last value (self.log's default in training_step); expected on_epoch left out, or "
                    "--trainer.fit_runner trainer for Lightning's epoch reductions")
        real(name, value, prog_bar, logger, on_step, on_epoch, *args, **kwargs)

    return log


def training_step_output_error(module: Any, out: Any) -> ConfigError:
    """The one line for a ``training_step`` output that Lightning's ``Trainer`` refuses in automatic optimisation
    — a dict without a ``"loss"`` tensor, or anything but a tensor, such a dict or ``None`` (a float, say) — refused
    here too rather than trained as a skipped step.

    Example:
        >>> print(training_step_output_error(torch.nn.Linear(1, 1), {"Loss": 1.0}))
        Linear.training_step returned a dict without a 'loss' tensor (keys: 'Loss'): expected the loss tensor, a dict holding it under 'loss', or None to skip the batch (as Lightning's Trainer requires)
    """
    if isinstance(out, Mapping):
        what = (f"a dict whose 'loss' is a {type(out['loss']).__name__}" if "loss" in out else
                f"a dict without a 'loss' tensor (keys: {', '.join(repr(k) for k in list(out)[:5])})")
    else:
        what = f"a {type(out).__name__}"
    return ConfigError(f"{type(module).__qualname__}.training_step returned {what}: expected the loss tensor, a dict "
                       "holding it under 'loss', or None to skip the batch (as Lightning's Trainer requires)")


def _to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device``: as it is when every tensor is there already (no copy, no traversal cost beyond a
    check), else Lightning's ``move_data_to_device``."""
    if transfer.ALWAYS_PACK:  # (a device run simulated on the CPU: the batch is on "the device")
        transfer.mark_placed((t for t in tree_leaves(batch) if isinstance(t, Tensor)), device)
    if isinstance(batch, (tuple, list)) and all(not isinstance(t, Tensor) or t.device == device for t in batch):
        return batch
    if isinstance(batch, Tensor) and batch.device == device:
        return batch
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(batch, device)
