"""The :class:`FederatedLoop`: rounds of client sampling, local Lightning fits, aggregation, evaluation, logging and
checkpointing.

One round (0-based ``round_idx``)::

    on_round_start
    participants = select_clients(...)                     # policy; default: uniform, seeded by (seed, round)
    for client in participants:                            # order-independent: every stream is seeded by
        message = client_message(client)                   #   (seed, round, client); on_client_message edits it
        load message (or the personal state) into the working module
        on_client_fit_start → Trainer.fit (Lightning hooks) → ClientUpdate → on_client_fit_end
    on_before_aggregate → global = aggregate(updates) → on_after_aggregate      # default: sample-weighted FedAvg
    every eval_every rounds: personal (and global) model of every client on its own test data
    on_round_end → metrics.jsonl, TensorBoard → checkpoint (atomic)

Nothing in the loop is specific to a method: masks, personal weights, residuals and gates are client state declared
by callbacks; downstream messages and aggregation are policies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.callbacks.base import POLICIES, FederatedCallback
from pl_fedsparse.checkpoint import atomic_write_text, dumps_json, load_checkpoint, save_checkpoint
from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message, to_cpu_state
from pl_fedsparse.errors import CheckpointError, ConfigError, check
from pl_fedsparse.evaluation import CLEAN, EvalView, kind_metric, logits_metrics, merge_views, view_metric_prefix
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.metrics import SERVER, CommLedger, TrainFlops, summarize_accuracies
from pl_fedsparse.topology import Star, Topology

__all__ = ["FederatedLoop", "stream_seed"]

log = logging.getLogger(__name__)

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed")
_STREAM_SAMPLE, _STREAM_FIT, _STREAM_EVAL = 1, 2, 3


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for the random stream named by ``(seed, *keys)`` (e.g. ``(seed, round, client)``).

    Example:
        >>> stream_seed(0, 1, 2) == stream_seed(0, 1, 2), stream_seed(0, 1, 2) == stream_seed(0, 2, 1)
        (True, False)
    """
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *[int(k) & 0xFFFFFFFF for k in keys]])
               .generate_state(2, np.uint64)[0] >> np.uint64(1))


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-Trainer info lines and per-fit warnings (one Trainer per client fit)."""
    names = ["lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
             "lightning.pytorch.accelerators.cuda"]
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        warnings.filterwarnings("ignore", message=r".*(num_workers|log_every_n_steps|does not have many workers).*")
        try:
            yield
        finally:
            for n, lv in levels.items():
                logging.getLogger(n).setLevel(lv)


class FederatedLoop:
    """Runs a federation of per-client Lightning fits.

    Args:
        num_rounds: number of communication rounds.
        join_ratio: fraction of clients sampled per round, in (0, 1].
        clients_per_round: number of clients per round (overrides ``join_ratio`` when set).
        local_epochs: epochs of local training per client and round (Lightning's ``max_epochs`` of each fit).
        local_steps: if set, optimizer steps per fit instead of epochs.
        eval_every: evaluate every this many rounds (and always after the last round).
        eval_split: client split used for evaluation during ``fit``.
        eval_global: also evaluate the global model (when there is one) on every client's data.
        accelerator: Lightning accelerator (``"cpu"``, ``"gpu"``, ``"auto"``).
        devices: devices per client fit (one client fit runs on one device).
        precision: ``"32-true"``, ``"16-mixed"`` or ``"bf16-mixed"`` (Lightning's names).
        gradient_clip_val: clip the gradient norm at this value in every local step (DisPFL's code: 10).
        default_root_dir: the run directory (``metrics.jsonl``, ``summary.json``, ``config.yaml``,
            ``tensorboard/``, ``checkpoints/``); default ``runs/run-<timestamp>``.
        overwrite: allow writing into a directory that holds another run.
        checkpoint_every: write ``checkpoints/last.ckpt`` every this many rounds (0: only at the end).
        logger: write TensorBoard event files.
        enable_progress_bar: progress bar over rounds and clients (default: only on a terminal).
        topology: communication graph (default :class:`~pl_fedsparse.topology.Star`).
        callbacks: the method, as a list of (federated) callbacks.
        seed: federation seed (``pl-fed`` sets it from ``--seed_everything``).

    Example:
        .. code-block:: yaml

            trainer:
              num_rounds: 100
              join_ratio: 0.1
              local_epochs: 5
              precision: bf16-mixed
              callbacks:
                - class_path: pl_fedsparse.callbacks.FineTune
                  init_args: {epochs: 5}
    """

    def __init__(
        self,
        *,
        num_rounds: int = 10,
        join_ratio: float = 1.0,
        clients_per_round: int | None = None,
        local_epochs: int = 1,
        local_steps: int | None = None,
        eval_every: int = 1,
        eval_split: Literal["test", "val"] = "test",
        eval_global: bool = True,
        accelerator: str = "auto",
        devices: int | str = 1,
        precision: str = "32-true",
        gradient_clip_val: float | None = None,
        default_root_dir: str | None = None,
        overwrite: bool = False,
        checkpoint_every: int = 1,
        logger: bool = True,
        enable_progress_bar: bool | None = None,
        topology: Topology | None = None,
        callbacks: list[pl.Callback] | None = None,
        seed: int = 0,
    ) -> None:
        check(isinstance(num_rounds, int) and num_rounds >= 1, "trainer.num_rounds", num_rounds, "an int >= 1")
        check(0 < join_ratio <= 1, "trainer.join_ratio", join_ratio, "a number in (0, 1]")
        check(clients_per_round is None or clients_per_round >= 1, "trainer.clients_per_round", clients_per_round,
              "an int >= 1 or null")
        check(local_epochs >= 1, "trainer.local_epochs", local_epochs, "an int >= 1")
        check(local_steps is None or local_steps >= 1, "trainer.local_steps", local_steps, "an int >= 1 or null")
        check(eval_every >= 1, "trainer.eval_every", eval_every, "an int >= 1")
        check(eval_split in ("test", "val"), "trainer.eval_split", eval_split, "one of test, val")
        check(precision in PRECISIONS, "trainer.precision", precision, "one of " + ", ".join(PRECISIONS))
        check(devices in (1, "1", "auto"), "trainer.devices", devices, "1 (one client fit runs on one device)")
        check(accelerator in ("auto", "cpu", "gpu", "cuda", "mps"), "trainer.accelerator", accelerator,
              "one of auto, cpu, gpu, cuda, mps")
        check(gradient_clip_val is None or gradient_clip_val > 0, "trainer.gradient_clip_val", gradient_clip_val,
              "a number > 0 or null")
        check(checkpoint_every >= 0, "trainer.checkpoint_every", checkpoint_every, "an int >= 0")
        self.num_rounds = num_rounds
        self.join_ratio = join_ratio
        self.clients_per_round = clients_per_round
        self.local_epochs = local_epochs
        self.local_steps = local_steps
        self.eval_every = eval_every
        self.eval_split = eval_split
        self.eval_global = eval_global
        self.accelerator = accelerator
        self.precision = precision
        self.gradient_clip_val = gradient_clip_val
        self.default_root_dir = default_root_dir
        self.overwrite = overwrite
        self.checkpoint_every = checkpoint_every
        self.logger = logger
        self.enable_progress_bar = enable_progress_bar
        self.topology = topology if topology is not None else Star()
        self.callbacks: list[pl.Callback] = list(callbacks or [])
        self.seed = int(seed)
        #: YAML text of the full configuration; ``pl-fed`` sets it and the loop writes it as ``config.yaml``
        self.config_text: str | None = None

        self.client_store = ClientStateStore()
        self.comm = CommLedger()
        self.global_state: dict[str, Tensor] | None = None
        self.initial_state: dict[str, Tensor] = {}
        self.round_idx = 0
        self.history: list[dict[str, Any]] = []
        self.model: pl.LightningModule | None = None
        self.datamodule: Any = None
        self.run_dir: Path | None = None
        self.flops_cum = 0.0
        self.client_flops: dict[int, float] = {}
        self.time_cum = 0.0
        self._flops: TrainFlops | None = None
        self._owners: dict[str, FederatedCallback] = {}
        self._writer: Any = None
        self._round_flops = 0.0
        self._last_client_acc: list[float] = []

    # ------------------------------------------------------------------------------------------------ properties
    @property
    def fed_callbacks(self) -> list[FederatedCallback]:
        """The callbacks that receive federation hooks."""
        return [c for c in self.callbacks if isinstance(c, FederatedCallback)]

    @property
    def num_clients(self) -> int:
        return int(self.datamodule.num_clients)

    @property
    def device(self) -> torch.device:
        """Device of local fits and evaluation."""
        if self.accelerator in ("gpu", "cuda") or (self.accelerator == "auto" and torch.cuda.is_available()):
            return torch.device("cuda", torch.cuda.current_device())
        if self.accelerator == "mps":
            return torch.device("mps")
        return torch.device("cpu")

    # ------------------------------------------------------------------------------------------------ hooks
    def call(self, hook: str, *args: Any) -> None:
        """Call a broadcast hook on every federated callback, in list order."""
        for cb in self.fed_callbacks:
            getattr(cb, hook)(self, *args)

    def _owner(self, policy: str) -> FederatedCallback | None:
        return self._owners.get(policy)

    def _resolve_policies(self) -> None:
        self._owners = {}
        keys = [cb.state_key for cb in self.fed_callbacks]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ConfigError(f"trainer.callbacks={dup} is invalid: expected each callback at most once "
                              "(give repeated callbacks distinct arguments or subclass them)")
        for cb in self.fed_callbacks:
            for p in type(cb).owned_policies():
                if p in self._owners:
                    raise ConfigError(
                        f"trainer.callbacks is invalid: policy {p!r} is claimed by both "
                        f"{type(self._owners[p]).__name__} and {type(cb).__name__}; expected one owner per policy"
                    )
                self._owners[p] = cb

    # ------------------------------------------------------------------------------------------------ policies
    def select_clients(self, round_idx: int) -> list[int]:
        """Participants of ``round_idx`` (policy ``select_clients``; default: uniform without replacement among the
        clients the topology has not dropped this round)."""
        ids = list(range(self.num_clients))
        owner = self._owner("select_clients")
        if owner is not None:
            return sorted(owner.select_clients(self, round_idx, ids))
        ids = [k for k in ids if k not in self.topology.dropped(round_idx, len(ids), self.seed)]
        m = self.clients_per_round or max(1, int(self.join_ratio * self.num_clients + 1e-9))
        if m >= len(ids):
            return ids
        rng = np.random.default_rng(stream_seed(self.seed, _STREAM_SAMPLE, round_idx))
        return sorted(int(i) for i in rng.choice(len(ids), size=m, replace=False))

    def client_message(self, client_idx: int) -> Message | None:
        """What the server sends ``client_idx`` (policy; default: the dense global model)."""
        owner = self._owner("client_message")
        if owner is not None:
            message = owner.client_message(self, client_idx)
        else:
            message = None if self.global_state is None else Message(self.global_state)
        if message is not None:
            self.call("on_client_message", client_idx, message)
        return message

    def aggregate(self, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        """New global state (policy; default: FedAvg weighted by training samples, McMahan et al. 2017)."""
        owner = self._owner("aggregate")
        if owner is not None:
            return owner.aggregate(self, updates)
        sent = [u for u in updates if u.message is not None]
        if self.global_state is None or not sent:
            return self.global_state
        merged = weighted_average([u.message.tensors for u in sent], [u.n_samples for u in sent])  # type: ignore[union-attr]
        return {**self.global_state, **merged}

    def personal_state(self, client_idx: int) -> dict[str, Tensor]:
        """State of the client's personal model (policy; default: the global model)."""
        owner = self._owner("personal_state")
        if owner is not None:
            return owner.personal_state(self, client_idx)
        if self.global_state is None:
            raise ConfigError("trainer.callbacks is invalid: the method keeps no global model, so a callback must "
                              "own the 'personal_state' policy (e.g. pl_fedsparse.callbacks.LocalTraining)")
        return self.global_state

    # ------------------------------------------------------------------------------------------------ client work
    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Load a (full) state dict into the working module, in place."""
        assert self.model is not None
        with torch.no_grad():
            own = self.model.state_dict(keep_vars=True)
            for k, v in state.items():
                own[k].copy_(v)

    def _make_trainer(self, epochs: int | None) -> pl.Trainer:
        steps = self.local_steps if epochs is None else None
        return pl.Trainer(
            accelerator=self.accelerator, devices=1, precision=self.precision,  # type: ignore[arg-type]
            max_epochs=-1 if steps else (epochs or self.local_epochs), max_steps=steps or -1,
            callbacks=self.callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            gradient_clip_val=self.gradient_clip_val, default_root_dir=str(self.run_dir or "."),
        )

    def fit_client(self, client_idx: int, start_state: Mapping[str, Tensor], round_idx: int,
                   epochs: int | None = None, stream: int = 0, kind: str = "train") -> ClientUpdate:
        """Train one client locally from ``start_state`` through Lightning and return its :class:`ClientUpdate`.

        Randomness (shuffling, augmentation, dropout) is seeded by ``(seed, round, client)``, so the order in which
        clients are processed does not change the result. Callbacks that fit clients a second time in a round
        (e.g. fine-tuning) pass their own ``stream`` id so their random streams differ from the main fit's.
        """
        assert self.model is not None
        module = self.model
        self.load_state(start_state)
        module.round_idx = round_idx  # type: ignore[attr-defined]
        fit_seed = stream_seed(self.seed, _STREAM_FIT, round_idx, client_idx, stream)
        torch.manual_seed(fit_seed)
        self.call("on_client_fit_start", module, client_idx)
        loader = self.datamodule.train_loader(client_idx, seed=fit_seed)
        with _quiet_lightning():
            self._make_trainer(epochs).fit(module, train_dataloaders=loader)
        state = to_cpu_state(module.state_dict())
        metrics = module.fit_metrics() if hasattr(module, "fit_metrics") else {}
        update = ClientUpdate(client_idx=client_idx, round_idx=round_idx,
                              n_samples=int(self.datamodule.num_samples(client_idx, "train")), state=state,
                              message=Message(state), metrics=metrics, kind=kind)
        self.call("on_client_fit_end", module, update)
        samples = metrics.get("samples_seen", update.n_samples * (epochs or self.local_epochs))
        assert self._flops is not None
        self.add_flops(update, samples * self._flops.per_sample(TrainFlops.densities(update.masks)))
        return update

    def add_flops(self, update: ClientUpdate, flops: float) -> None:
        """Charge ``flops`` of training compute to ``update``'s client (and to the round and the federation)."""
        update.flops += flops
        self.flops_cum += flops
        self.client_flops[update.client_idx] = self.client_flops.get(update.client_idx, 0.0) + flops
        self._round_flops += flops

    def dense_flops_per_sample(self) -> float:
        """Training FLOPs per sample of the dense model (forward + backward)."""
        assert self._flops is not None
        return self._flops.per_sample()

    def _eval_loader(self, client_idx: int, split: str, shift: float = 0.0, corruption: str | None = None,
                     severity: int = 0) -> Any:
        return self.datamodule.eval_loader(client_idx, split=split, shift=shift,
                                           seed=stream_seed(self.seed, _STREAM_EVAL, client_idx),
                                           corruption=corruption, severity=severity)

    @torch.inference_mode()
    def _logits(self, loader: Any) -> tuple[Tensor, Tensor]:
        """CPU float logits and labels of the working module over an evaluation loader (autocast as in training)."""
        assert self.model is not None
        module = self.model.to(self.device)
        module.eval()
        dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self.precision)
        autocast = (torch.autocast(self.device.type, dtype=dtype) if dtype is not None
                    else contextlib.nullcontext())
        logits, labels = [], []
        for x, y in loader:
            x = x.to(self.device, non_blocking=True)
            with autocast:
                out = module(x)
            logits.append(out.float().cpu())
            labels.append(y.cpu())
        module.train()
        if not logits:
            return torch.zeros(0, int(self.datamodule.num_classes)), torch.zeros(0, dtype=torch.long)
        return torch.cat(logits), torch.cat(labels)

    def predict(self, client_idx: int, split: str = "test", shift: float = 0.0, corruption: str | None = None,
                severity: int = 0) -> tuple[Tensor, Tensor]:
        """CPU float logits and labels of the working module on one client's ``split`` data (optionally shifted
        and/or corrupted, :meth:`FederatedDataModule.eval_loader`). Mixed precision as in training."""
        return self._logits(self._eval_loader(client_idx, split, shift, corruption, severity))

    def evaluate_module(self, client_idx: int, split: str = "test", shift: float = 0.0) -> dict[str, float]:
        """Accuracy and loss of the working module on one client's ``split`` data."""
        return logits_metrics(*self.predict(client_idx, split, shift))

    def eval_views(self) -> dict[str, EvalView]:
        """The views of the coming evaluation: the clean one plus every callback's (:mod:`pl_fedsparse.evaluation`)."""
        views: dict[str, EvalView] = {CLEAN.name: CLEAN}
        for cb in self.fed_callbacks:
            merge_views(views, list(cb.eval_views(self)))
        return views

    def evaluate(self, split: str | None = None) -> dict[str, Any]:
        """Evaluate every client's personal model (and the global model) on the client's own data, on the clean view
        and on every view the callbacks ask for (:mod:`pl_fedsparse.evaluation`)."""
        split = split or self.eval_split
        views = self.eval_views()
        has_global = self.global_state is not None and self.eval_global
        # the personal result can stand for the global one only if no callback edits the loaded model
        edits = any(type(cb).on_client_evaluate_start is not FederatedCallback.on_client_evaluate_start
                    for cb in self.fed_callbacks)
        per_client: list[dict[str, dict[str, dict[str, float]]]] = []  # [client][view][kind] -> metrics
        for k in range(self.num_clients):
            # one loader per distinct view (shifted / corrupted once per client), shared by every model kind
            loaders: dict[tuple, Any] = {}
            for v in views.values():
                if v.key not in loaders:
                    loaders[v.key] = self._eval_loader(k, "train" if v.split == "train" else split, v.shift,
                                                       v.corruption, v.severity)
            state = self.personal_state(k)
            kinds = [("personal", state)] + ([("global", self.global_state)] if has_global else [])
            outputs: dict[str, dict[str, Tensor]] = {name: {} for name in views}
            labels: dict[str, Tensor] = {}
            for kind, st in kinds:
                if kind == "global" and state is self.global_state and not edits:
                    for name in views:
                        outputs[name]["global"] = outputs[name]["personal"]
                    continue
                self.load_state(st)  # type: ignore[arg-type]
                self.call("on_client_evaluate_start", self.model, k, kind)
                results = {key: self._logits(loader) for key, loader in loaders.items()}
                self.call("on_client_evaluate_end", self.model, k, kind, logits_metrics(*results[CLEAN.key]))
                for name, v in views.items():
                    outputs[name][kind], labels[name] = results[v.key]
            self.call("on_client_predictions", k, outputs, labels)
            per_client.append({name: {kind: logits_metrics(lg, labels[name]) for kind, lg in kinds_out.items()}
                               for name, kinds_out in outputs.items() if views[name].report})
        out: dict[str, Any] = {}
        for name, v in views.items():
            if not v.report:
                continue
            prefix = view_metric_prefix(name)
            nv = [int(pc[name]["personal"]["n"]) for pc in per_client]
            for kind in per_client[0][name] if per_client else []:
                s = summarize_accuracies([pc[name][kind]["acc"] for pc in per_client], nv)
                if kind == "personal":
                    out.update({f"{prefix}{key}": val for key, val in s.items()})
                    if name == CLEAN.name:
                        out["loss_mean"] = float(np.mean([pc[name][kind]["loss"] for pc in per_client]))
                else:
                    out[f"{prefix}{kind_metric(kind)}"] = s["acc_mean"]
                    out[f"{prefix}{kind}_acc_weighted"] = s["acc_weighted"]
        out.setdefault("global_acc", None)
        self.call("on_evaluation_end", out)
        out["client_acc"] = [pc[CLEAN.name]["personal"]["acc"] for pc in per_client]
        return out

    # ------------------------------------------------------------------------------------------------ a round
    def run_round(self, round_idx: int) -> dict[str, Any]:
        """Run one round and return its metrics row."""
        t0 = time.perf_counter()
        self.round_idx = round_idx
        self._round_flops = 0.0
        self.call("on_round_start", round_idx)
        participants = self.select_clients(round_idx)
        updates: list[ClientUpdate] = []
        for k in self._progress(participants, f"round {round_idx}", leave=False):
            message = self.client_message(k)
            if message is not None and self.topology.has_server:  # peer methods record each link themselves
                self.comm.record(SERVER, k, message.nbytes())
            if message is not None:
                start = {**self.global_state, **message.tensors} if self.global_state else message.tensors
            else:
                start = self.personal_state(k)
            update = self.fit_client(k, start, round_idx)
            if update.message is not None and self.topology.has_server:
                self.comm.record(k, SERVER, update.message.nbytes())
            updates.append(update)
        self.call("on_before_aggregate", updates)
        self.global_state = self.aggregate(updates)
        self.call("on_after_aggregate")
        t_train = time.perf_counter() - t0
        row: dict[str, Any] = {"round": round_idx}
        last = round_idx == self.num_rounds - 1
        evaluated = (round_idx + 1) % self.eval_every == 0 or last
        if evaluated:
            ev = self.evaluate()
            self._last_client_acc = ev.pop("client_acc")
            row.update(ev)
        row.update(self.comm.end_round())
        row["flops_train"] = self._round_flops
        row["flops_train_per_client"] = self._round_flops / max(len(participants), 1)
        row["flops_train_cum"] = self.flops_cum
        row["train_loss"] = float(np.mean([u.metrics.get("train_loss", np.nan) for u in updates])) if updates else None
        row["num_participants"] = len(participants)
        self.call("on_round_end", round_idx, row)
        row["time_train_s"] = t_train
        row["time_s"] = time.perf_counter() - t0
        self.time_cum += row["time_s"]
        row["time_cum_s"] = self.time_cum
        row["evaluated"] = evaluated
        return row

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Run the federation (resuming from ``ckpt_path`` when given) and return the final summary."""
        self._setup(model, datamodule, ckpt_path, stage="fit")
        start = self.round_idx
        self.call("on_federation_start")
        rounds = self._progress(range(start, self.num_rounds), "rounds", leave=True)
        for r in rounds:
            row = self.run_round(r)
            self._log_row(row)
            if hasattr(rounds, "set_postfix") and row.get("acc_mean") is not None:
                rounds.set_postfix(acc=f"{row['acc_mean']:.3f}")
            self.round_idx = r + 1
            if self.checkpoint_every and ((r + 1) % self.checkpoint_every == 0 or r + 1 == self.num_rounds):
                self.save_checkpoint()
        self.call("on_federation_end")
        if self.checkpoint_every == 0:
            self.save_checkpoint()
        summary = self._summary()
        atomic_write_text(self._path("summary.json"), dumps_json(summary) + "\n")
        if self._writer is not None:
            self._writer.close()
        print(self.results_table(summary))
        return summary

    def validate(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Evaluate every client's personal (and the global) model on its validation split."""
        return self._evaluate_only(model, datamodule, ckpt_path, "val")

    def test(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Evaluate every client's personal (and the global) model on its test split."""
        return self._evaluate_only(model, datamodule, ckpt_path, "test")

    def _evaluate_only(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None,
                       split: str) -> dict[str, Any]:
        if ckpt_path is None:
            log.warning("no --ckpt_path given: evaluating the freshly initialised model")
        self._setup(model, datamodule, ckpt_path, stage=split)
        if split == "val" and sum(datamodule.num_samples(k, "val") for k in range(self.num_clients)) == 0:
            raise ConfigError("data.split_ratios is invalid for validate: expected a non-zero validation share "
                              "(e.g. [0.6, 0.2, 0.2]); use `pl-fed test` to evaluate on the test split")
        ev = self.evaluate(split)
        ev.pop("client_acc")
        out = {"split": split, "round": self.round_idx, **ev}
        print(self.results_table(out, title=f"{split} results"))
        return out

    # ------------------------------------------------------------------------------------------------ setup
    def _setup(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None, stage: str) -> None:
        self.model, self.datamodule = model, datamodule
        datamodule.setup("fit")
        self._check_environment()
        self._resolve_policies()
        self.client_store = ClientStateStore()
        self.comm = CommLedger()
        self.history, self.round_idx, self.flops_cum, self.client_flops, self.time_cum = [], 0, 0.0, {}, 0.0
        self.initial_state = to_cpu_state(model.state_dict())
        self.global_state = dict(self.initial_state) if self.topology.has_server else None
        example = datamodule.example_input(2)
        with _quiet_lightning():
            self._flops = TrainFlops(model, example)
        for cb in self.fed_callbacks:
            cb.setup_federation(self)
        ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
        if ckpt is not None:  # validated before anything is written
            self._restore(ckpt, ckpt_path)  # type: ignore[arg-type]
        if stage == "fit":
            self._prepare_run_dir(resuming=ckpt is not None)
            if self.config_text is not None:
                atomic_write_text(self._path("config.yaml"), self.config_text)
            self._rewrite_metrics()
            if self.logger:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self._path("tensorboard")))

    def _check_environment(self) -> None:
        dev = self.device
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={self.accelerator!r} is invalid: expected cpu or auto "
                              "(no CUDA device is available)")
        if dev.type == "cpu" and self.precision == "16-mixed":
            raise ConfigError("trainer.precision='16-mixed' is invalid on CPU: expected 32-true or bf16-mixed")
        assert self.model is not None
        x = self.datamodule.example_input(2)
        try:
            with torch.no_grad():
                out = self.model(x)
        except RuntimeError as e:
            raise ConfigError(
                f"model.backbone={type(getattr(self.model, 'backbone', self.model)).__name__} is invalid: expected a "
                f"network accepting inputs of shape {tuple(x.shape[1:])} from data.name="
                f"{self.datamodule.name!r} ({str(e).splitlines()[0][:120]})") from None
        nc = int(self.datamodule.num_classes)
        if out.ndim != 2 or out.shape[1] != nc:
            raise ConfigError(f"model.backbone.init_args.num_classes={out.shape[-1]} is invalid: expected "
                              f"{nc} (the number of classes of data.name={self.datamodule.name!r})")

    def _prepare_run_dir(self, resuming: bool) -> None:
        root = self.default_root_dir or f"runs/run-{datetime.now():%Y%m%d-%H%M%S}"
        self.run_dir = Path(root)
        existing = self.run_dir / "metrics.jsonl"
        if existing.exists() and not resuming and not self.overwrite:
            raise ConfigError(
                f"trainer.default_root_dir={root!r} is invalid: it already holds a run; expected a new directory, "
                f"--ckpt_path {root}/checkpoints/last.ckpt to resume it, or --trainer.overwrite true")
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / name

    # ------------------------------------------------------------------------------------------------ checkpoint
    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must agree with to be resumed by this configuration."""
        assert self.model is not None
        return {
            "data": self.datamodule.fingerprint(),
            "model": type(getattr(self.model, "backbone", self.model)).__name__,
            "shapes": {k: list(v.shape) for k, v in self.initial_state.items()},
            "callbacks": [type(c).__name__ for c in self.fed_callbacks],
            "topology": type(self.topology).__name__,
            "seed": self.seed,
        }

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write everything needed to continue the federation, atomically."""
        path = Path(path) if path is not None else self._path("checkpoints") / "last.ckpt"
        state = {
            "round": self.round_idx,
            "fingerprint": dumps_json(self.fingerprint()),
            "global_state": self.global_state,
            "client_store": self.client_store.state_dict(),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "comm": self.comm.state_dict(),
            "flops_cum": self.flops_cum,
            "client_flops": dict(self.client_flops),
            "time_cum": self.time_cum,
            "history": dumps_json(self.history),
            "last_client_acc": list(self._last_client_acc),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()[1],
                    "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
                    "numpy_pos": int(np.random.get_state()[2])},
        }
        save_checkpoint(path, state)
        return path

    def _restore(self, ckpt: dict[str, Any], ckpt_path: str) -> None:
        import json

        try:
            theirs = json.loads(ckpt["fingerprint"])
            mine = json.loads(dumps_json(self.fingerprint()))
            if theirs != mine:
                diff = _first_difference(theirs, mine)
                raise CheckpointError(
                    f"ckpt_path={ckpt_path!r} is invalid: it was written by another configuration ({diff}); "
                    f"expected a checkpoint of this run (resume with the run's config.yaml)")
            self.round_idx = int(ckpt["round"])
            self.global_state = ckpt["global_state"]
            self.client_store.load_state_dict(ckpt["client_store"])
            for cb in self.callbacks:
                if cb.state_key in ckpt["callbacks"]:
                    cb.load_state_dict(ckpt["callbacks"][cb.state_key])
            self.comm.load_state_dict(ckpt["comm"])
            self.flops_cum = float(ckpt["flops_cum"])
            self.client_flops = {int(k): float(v) for k, v in ckpt["client_flops"].items()}
            self.time_cum = float(ckpt["time_cum"])
            self.history = json.loads(ckpt["history"])
            self._last_client_acc = list(ckpt["last_client_acc"])
            torch.set_rng_state(ckpt["rng"]["torch"])
            random.setstate((3, tuple(ckpt["rng"]["python"]), None))
            np.random.set_state(("MT19937", ckpt["rng"]["numpy"].numpy().astype(np.uint32),
                                 int(ckpt["rng"]["numpy_pos"])))
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"ckpt_path={ckpt_path!r} is invalid: expected a complete pl_fedsparse "
                                  f"checkpoint ({type(e).__name__}: {str(e)[:120]})") from None
        if self.round_idx > self.num_rounds:
            raise CheckpointError(f"trainer.num_rounds={self.num_rounds} is invalid: expected >= the checkpoint's "
                                  f"completed rounds ({self.round_idx})")

    # ------------------------------------------------------------------------------------------------ logging
    def _rewrite_metrics(self) -> None:
        lines = [dumps_json(r) for r in self.history if r.get("evaluated")]
        atomic_write_text(self._path("metrics.jsonl"), "".join(line + "\n" for line in lines))

    def _log_row(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if row.get("evaluated"):
            with open(self._path("metrics.jsonl"), "a", encoding="utf-8") as f:
                f.write(dumps_json(row) + "\n")
        if self._writer is not None:
            for k, v in row.items():
                if k not in ("round", "evaluated") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    if not (isinstance(v, float) and math.isnan(v)):
                        self._writer.add_scalar(k, v, row["round"])
            self._writer.flush()

    def _progress(self, it: Any, desc: str, leave: bool) -> Any:
        show = self.enable_progress_bar if self.enable_progress_bar is not None else sys.stderr.isatty()
        if not show:
            return it
        from tqdm.auto import tqdm

        return tqdm(it, desc=desc, leave=leave, dynamic_ncols=True)

    def _summary(self) -> dict[str, Any]:
        evaluated = [r for r in self.history if r.get("evaluated")]
        final = dict(evaluated[-1]) if evaluated else {}
        return {
            "run_dir": str(self.run_dir),
            "num_rounds": self.num_rounds,
            "num_clients": self.num_clients,
            "final": final,
            "best_acc_mean": max((r["acc_mean"] for r in evaluated), default=None),
            "client_acc": list(self._last_client_acc),
            "client_flops": [self.client_flops.get(k, 0.0) for k in range(self.num_clients)],
            "client_comm_bytes": [self.comm.cum_node.get(k, 0) for k in range(self.num_clients)],
            "comm_cum_bytes_total": self.comm.cum["total"],
            "comm_cum_bytes_up": self.comm.cum["up"],
            "comm_cum_bytes_down": self.comm.cum["down"],
            "comm_cum_busiest_node_bytes": max(self.comm.cum_node.values(), default=0),
            "flops_train_cum": self.flops_cum,
            "flops_train_per_client_mean": float(np.mean(list(self.client_flops.values()))) if self.client_flops
            else 0.0,
            "time_cum_s": self.time_cum,
        }

    @staticmethod
    def results_table(summary: Mapping[str, Any], title: str = "final results") -> str:
        """A small text table of the headline numbers."""
        row = summary.get("final", summary)

        def pct(v: Any) -> str:
            return "-" if v is None else f"{100 * v:.2f}%"

        items = [
            ("round", str(row.get("round", "-"))),
            ("personal acc (mean over clients)", pct(row.get("acc_mean"))),
            ("personal acc (sample-weighted)", pct(row.get("acc_weighted"))),
            ("personal acc (std)", pct(row.get("acc_std"))),
            ("personal acc (bottom decile)", pct(row.get("acc_bottom10"))),
            ("global model acc", pct(row.get("global_acc"))),
        ]
        extra = [("adaptive acc (DM-PFL+)", "adaptive_acc"), ("personal model alone", "personal_only_acc"),
                 ("personal acc @ 100 % shift", "shift100/acc_mean"), ("global acc @ 100 % shift", "shift100/global_acc"),
                 ("personal acc, mean over shifts", "shift_avg/acc_mean"),
                 ("personal acc, mean over corruptions", "corruption_avg/acc_mean")]
        items += [(label, pct(row[key])) for label, key in extra if row.get(key) is not None]
        if "comm_cum_bytes_total" in summary:
            items += [
                ("communication total (MB)", f"{summary['comm_cum_bytes_total'] / 1e6:.2f}"),
                ("busiest node (MB)", f"{summary['comm_cum_busiest_node_bytes'] / 1e6:.2f}"),
                ("training FLOPs (total)", f"{summary['flops_train_cum']:.3e}"),
                ("wall time (s)", f"{summary['time_cum_s']:.1f}"),
            ]
        width = max(len(k) for k, _ in items)
        lines = [f"== {title} " + "=" * max(0, width + 12 - len(title))]
        lines += [f"{k.ljust(width)}  {v:>10}" for k, v in items]
        if summary.get("run_dir"):
            lines.append(f"run directory: {summary['run_dir']}")
        return "\n".join(lines)


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return _first_difference(a.get(k), b.get(k), f"{path}.{k}" if path else k)
    return f"{path}: {a!r} in the checkpoint vs {b!r} now"
