"""What the loop checks before it runs, each failure one :class:`~pl_fedsparse.errors.ConfigError` line naming the
parameter, its value and what is allowed: its arguments (:func:`check_arguments`), the accelerator asked for
(:func:`resolve_device`) and that the clients have data to train and evaluate on (:func:`check_client_data`)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from pl_fedsparse.contract import CONTRACT_MODES
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.executors.runner import FIT_RUNNERS
from pl_fedsparse.functional.resident import parse_budget
from pl_fedsparse.metrics import EVAL_METRICS

log = logging.getLogger("pl_fedsparse.loop")

__all__ = ["PRECISIONS", "check_arguments", "check_client_data", "resolve_device"]

#: ``trainer.precision``: Lightning's precision settings a client fit accepts
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")


def check_arguments(*, num_rounds: Any, join_ratio: Any, clients_per_round: Any, local_epochs: Any, local_steps: Any,
                    eval_every: Any, eval_split: Any, eval_metrics: Any, precision: Any, devices: Any,
                    accelerator: Any, gradient_clip_val: Any, checkpoint_every: Any, on_client_fault: Any,
                    keep_checkpoints: Any, callback_contract: Any, fit_runner: Any,
                    device_state_budget: Any = "auto") -> None:
    """The :class:`~pl_fedsparse.loop.FederatedLoop`'s arguments (``trainer.*``), each checked in one line."""
    check(isinstance(num_rounds, int) and num_rounds >= 1, "trainer.num_rounds", num_rounds, "an int >= 1")
    check(0 < join_ratio <= 1, "trainer.join_ratio", join_ratio, "a number in (0, 1]")
    check(clients_per_round is None or clients_per_round >= 1, "trainer.clients_per_round", clients_per_round,
          "an int >= 1 or null")
    check(local_epochs >= 1, "trainer.local_epochs", local_epochs, "an int >= 1")
    check(local_steps is None or local_steps >= 1, "trainer.local_steps", local_steps, "an int >= 1 or null")
    check(eval_every >= 1, "trainer.eval_every", eval_every, "an int >= 1")
    check(eval_split in ("test", "val"), "trainer.eval_split", eval_split, "one of test, val")
    for metric in eval_metrics or []:
        check(metric in EVAL_METRICS, "trainer.eval_metrics", metric, "a list of " + ", ".join(EVAL_METRICS))
    check(precision in PRECISIONS, "trainer.precision", precision, "one of " + ", ".join(PRECISIONS))
    check(devices in (1, "1", "auto"), "trainer.devices", devices, "1 (one client fit runs on one device)")
    check(accelerator in ("auto", "cpu", "gpu", "cuda", "mps"), "trainer.accelerator", accelerator,
          "one of auto, cpu, gpu, cuda, mps")
    check(gradient_clip_val is None or gradient_clip_val > 0, "trainer.gradient_clip_val", gradient_clip_val,
          "a number > 0 or null")
    check(checkpoint_every >= 0, "trainer.checkpoint_every", checkpoint_every, "an int >= 0")
    check(on_client_fault in ("skip", "continue", "raise"), "trainer.on_client_fault", on_client_fault,
          "one of skip, continue, raise")
    check(isinstance(keep_checkpoints, int) and keep_checkpoints >= 1, "trainer.keep_checkpoints",
          keep_checkpoints, "an int >= 1")
    check(callback_contract in CONTRACT_MODES, "trainer.callback_contract", callback_contract,
          "one of " + ", ".join(CONTRACT_MODES))
    check(fit_runner in FIT_RUNNERS, "trainer.fit_runner", fit_runner, "one of " + ", ".join(FIT_RUNNERS))
    parse_budget(device_state_budget)


def resolve_device(accelerator: str) -> torch.device:
    """The device of local fits and evaluation for ``trainer.accelerator`` (a one-line ConfigError when the
    accelerator asked for is not there)."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={accelerator!r} is invalid: expected cpu or auto (no CUDA "
                          "device is available on this machine)")
    if accelerator == "mps" and not (torch.backends.mps.is_built() and torch.backends.mps.is_available()):
        raise ConfigError("trainer.accelerator='mps' is invalid: expected cpu or auto (no MPS device is "
                          "available on this machine)")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    if accelerator == "mps":
        return torch.device("mps")
    return torch.device("cpu")


def check_client_data(datamodule: Any, n: int, eval_split: str) -> None:
    """Before anything is written: every one of the ``n`` clients should have training data, and data for
    evaluation; say which do not (a client without training data faults at every fit; the client metrics average the
    clients that have evaluation data, and the rows' ``eval_clients`` says how many when some have none). None at all
    is one :class:`~pl_fedsparse.errors.ConfigError` line."""

    def ids(clients: list[int]) -> str:
        return ", ".join(map(str, clients[:10])) + (f", ... ({len(clients)} in all)" if len(clients) > 10 else "")

    no_train = [k for k in range(n) if int(datamodule.num_samples(k, "train")) == 0]
    if len(no_train) == n:
        raise ConfigError(f"data is invalid: none of its {n} clients has a training sample; expected training "
                          "data for the clients (check the partition and data.max_train_samples)")
    if no_train:
        log.warning("client(s) %s have no training sample: each of their fits is left out as a 'no_data' fault",
                    ids(no_train))
    no_eval = [k for k in range(n) if int(datamodule.num_samples(k, eval_split)) == 0]
    if len(no_eval) == n:
        raise ConfigError(f"data is invalid: none of its {n} clients has a {eval_split} sample; expected "
                          f"{eval_split} data to evaluate on (data.split_ratios / data.test_mode)")
    if no_eval:
        log.warning("client(s) %s have no %s sample: acc_mean and the other client metrics average the %d "
                    "clients that have (each row's eval_clients says so)", ids(no_eval), eval_split,
                    n - len(no_eval))
