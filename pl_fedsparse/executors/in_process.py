"""The in-process executor: a round's fits one after another in this process, on the loop's working module.

Each fit runs on the executor's persistent :class:`~pl_fedsparse.executors.runner.FitRunner` (``trainer.fit_runner:
auto``, the default, wherever the runner applies; ``fast`` insists on it) or, as the reference, through a fresh
Lightning ``Trainer`` per fit (``trainer.fit_runner: trainer``). Both give the same numbers (bit for bit on the CPU:
``tests/test_fit_runner.py``, ``benchmarks/parity.py``); the runner saves the ``Trainer``'s build and teardown per fit
(``benchmarks/fit_overhead.py``).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.context import fit_scope
from pl_fedsparse.errors import ConfigError, one_line_text
from pl_fedsparse.executors.base import (
    NO_LOSS_STEPS,
    ClientExecutor,
    FitMeter,
    FitRequest,
    begin_fit,
    end_fit,
    fault_to_raise,
    fit_update,
    logged_metrics,
    quiet_lightning,
)
from pl_fedsparse.executors.compiling import compile_module
from pl_fedsparse.executors.runner import FitRunner, RunnerUnsupported, _RequireOptimizer, runner_support
from pl_fedsparse.metrics import StepLosses
from pl_fedsparse.module import FederatedModule
from pl_fedsparse.signals import interrupt_in

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["InProcessExecutor"]

log = logging.getLogger(__name__)


class InProcessExecutor(ClientExecutor):
    """Run fits one after another in this process on the loop's working module: on one persistent
    :class:`~pl_fedsparse.executors.runner.FitRunner`, or each through a fresh Lightning ``Trainer``
    (``trainer.fit_runner``; see the module docstring)."""

    def __init__(self) -> None:
        self.loop: FederationView | None = None
        self.runner: FitRunner | None = None
        #: why the runner does not apply to this federation (``None``: it does, or it has not been asked yet)
        self.runner_off: str | None = None
        #: whether updates stay on the weights' device until their fit ends (``None``: not asked yet)
        self.device_update: bool | None = None
        #: the Trainer of the last fit that ran on one (what its ``self.log`` calls recorded is read from it)
        self._last_trainer: Any = None

    def setup(self, loop: FederationView) -> None:
        self.loop = loop
        self.runner, self.runner_off, self.device_update = None, None, None
        if loop.model is not None:  # (trainer.compile, or a module torch.compile returned: compiled here, once)
            compile_module(loop.model, getattr(loop, "compile", False), getattr(loop, "_compiled_model", None))
        mode = getattr(loop, "fit_runner", "auto")
        if mode == "trainer":
            return
        why = runner_support(loop.model, loop.callbacks) if loop.model is not None else None
        if why is not None:
            self._runner_unsupported(why)

    @property
    def message_device(self) -> torch.device | None:
        """The loop's device: the fits run here, on it."""
        return None if self.loop is None else self.loop.device

    def _runner_unsupported(self, why: str) -> None:
        loop = self.loop
        assert loop is not None
        if getattr(loop, "fit_runner", "auto") == "fast":
            raise ConfigError(f"trainer.fit_runner='fast' is invalid here: {why}; expected auto or trainer (a "
                              "lightning.Trainer per fit)")
        if self.runner_off is None:
            log.info("client fits run through a lightning.Trainer each (trainer.fit_runner=auto): %s", why)
        self.runner_off = why

    def _runner(self) -> FitRunner | None:
        """The persistent runner, when this federation's fits use it."""
        loop = self.loop
        assert loop is not None
        if getattr(loop, "fit_runner", "auto") == "trainer" or self.runner_off is not None:
            return None
        if type(self).make_trainer is not InProcessExecutor.make_trainer:  # a subclass builds its own Trainer
            return None
        if self.runner is None:
            self.runner = FitRunner(loop.device, loop.precision, loop.gradient_clip_val)
        return self.runner

    def make_trainer(self, epochs: int | None) -> pl.Trainer:
        loop = self.loop
        assert loop is not None
        steps = loop.local_steps if epochs is None else None
        return pl.Trainer(
            accelerator=loop.accelerator, devices=1, precision=loop.precision,  # type: ignore[arg-type]
            max_epochs=-1 if steps else (epochs or loop.local_epochs), max_steps=steps or -1,
            callbacks=[_RequireOptimizer(), *loop.callbacks], logger=False, enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            gradient_clip_val=loop.gradient_clip_val, default_root_dir=str(loop.run_dir or "."),
        )

    def run(self, requests: Sequence[FitRequest]) -> list[ClientUpdate]:
        return [self.run_one(r) for r in requests]

    def run_one(self, request: FitRequest) -> ClientUpdate:
        """Run one fit. A fit that raises (with ``trainer.on_client_fault: skip``) or produces a non-finite loss,
        weight or upload comes back with ``update.fault`` set and the client's state as it was before the fit."""
        loop = self.loop
        assert loop is not None and loop.model is not None
        ctx, module, k = request.context, loop.model, request.context.client_idx
        watch, n_samples = begin_fit(loop, request)
        update, error = None, None
        try:
            with fit_scope(ctx):
                loop.call("on_client_fit_start", module, ctx)
                loader = loop.datamodule.train_loader(k, seed=ctx.seed)
                fit_metrics: Any = getattr(module, "fit_metrics", None)  # (FederatedModule's, or the user's own)
                meter = None if callable(fit_metrics) else FitMeter()
                runner = self._fit(ctx.epochs, module, loader, meter)
                losses = self._losses_read_later(module, meter)
                metrics = {} if losses is not None else fit_metrics() if meter is None else meter.metrics()
                update = fit_update(module, ctx, n_samples, metrics, on_device=self._device_update())
                if losses is not None:  # (the loss read with the update's copy when the fit ends: no wait now;
                    # until then update.metrics holds a PendingMetric in its place)
                    update.metrics = losses.metrics_on_host(update)  # type: ignore[assignment]
                update.metrics.update(logged_metrics(runner.trainer if runner is not None else self._last_trainer))
                if runner is not None and runner.steps_run and runner.steps_without_loss == runner.steps_run:
                    update.extras[NO_LOSS_STEPS] = runner.steps_run  # (find_fault names it)
                loop.call("on_client_fit_end", module, update)
        except ConfigError:  # the configuration, not the client (e.g. trainer.fit_runner=fast where it cannot)
            raise
        except MisconfigurationException as e:  # Lightning's Trainer refusing the module (e.g. what a step returns)
            raise ConfigError(f"{one_line_text(e)} ({type(module).__qualname__}; Lightning's Trainer, "
                              f"client {k}, round {ctx.round_idx})") from e
        except Exception as e:  # a failing client must not stop the federation (KeyboardInterrupt is not caught)
            if loop.on_client_fault == "raise":
                raise fault_to_raise(loop, ctx, e)  # noqa: B904 (its cause is e)
            error = e
        return end_fit(loop, request, watch, n_samples, update, error)

    def _losses_read_later(self, module: pl.LightningModule, meter: FitMeter | None) -> StepLosses | None:
        """The fit's losses, where its metrics are the engine's own (a :class:`FitMeter`, or
        :class:`~pl_fedsparse.module.FederatedModule`'s ``fit_metrics`` not overridden) and every callback takes the
        update on the device (:meth:`_device_update`): their read then goes with the update's copy to the host
        (:meth:`~pl_fedsparse.metrics.StepLosses.metrics_on_host`) instead of waiting for the fit on its own.
        ``None``: ``fit_metrics`` (or the meter) is asked now."""
        if not self._device_update():
            return None
        if meter is not None:
            return meter.losses
        if getattr(type(module), "fit_metrics", None) is FederatedModule.fit_metrics and isinstance(
                getattr(module, "_step_losses", None), StepLosses):
            return module._step_losses  # type: ignore[return-value]
        return None

    def _device_update(self) -> bool:
        """Whether the fits' updates stay where the weights trained until the fit ends (every callback takes them
        there: :func:`~pl_fedsparse.callbacks.base.takes_device_update`), asked once."""
        if self.device_update is None:
            from pl_fedsparse.callbacks.base import takes_device_update

            assert self.loop is not None
            self.device_update = takes_device_update(self.loop.callbacks)
        return self.device_update

    def _fit(self, epochs: int | None, module: pl.LightningModule, loader: Any,
             meter: FitMeter | None = None) -> FitRunner | None:
        """Run one fit on the runner (returned) or a fresh Trainer (``None`` returned)."""
        loop = self.loop
        assert loop is not None
        runner = self._runner()
        if runner is not None:
            steps = loop.local_steps if epochs is None else None
            callbacks = [*loop.callbacks, meter] if meter is not None else loop.callbacks
            try:
                runner.fit(module, loader, callbacks, max_epochs=-1 if steps else (epochs or loop.local_epochs),
                           max_steps=steps or -1)
                return runner
            except RunnerUnsupported as e:  # raised before any step: this fit (and the next) on a Trainer
                self._runner_unsupported(str(e))
        handler = signal.getsignal(signal.SIGINT)
        with quiet_lightning():
            trainer = self._last_trainer = self.make_trainer(epochs)
            if meter is not None:  # last: it reads what training_step returned
                trainer.callbacks.append(meter)  # type: ignore[attr-defined]  # set by its connector
        try:
            with quiet_lightning():
                trainer.fit(module, train_dataloaders=loader)
        except SystemExit as e:
            # Lightning turns Ctrl-C (and SIGTERM, pl_fedsparse.signals) during a fit into a graceful shutdown and
            # sys.exit(1), ignoring further SIGINTs: give the interrupt back (and the handler), so that the run stops
            # with its resume message and exit status
            if trainer.interrupted:
                signal.signal(signal.SIGINT, handler)
                interrupt = interrupt_in(e)
                raise (interrupt if interrupt is not None else KeyboardInterrupt()) from None
            raise
        return None
