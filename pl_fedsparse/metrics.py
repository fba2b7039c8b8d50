"""Federation metrics and accounting.

* :func:`summarize_accuracies` — unweighted mean over clients, sample-weighted mean, population std, bottom decile
  (the ``⌊N/10⌋``-th worst client, 0-based, as pFedGate/FedEM report it).
* :class:`CommLedger` — bytes per link, counted from the messages actually sent
  (:mod:`pl_fedsparse.functional.accounting` has the byte rules), per round and cumulative, with the busiest node.
* :class:`Accounting` — the one API through which the loop *and callbacks* charge traffic (``send``) and training
  compute (``charge_flops``, ``charge_training``), per client, per round and cumulative.
* :class:`TrainFlops` — training FLOPs per sample measured once with :mod:`torch.utils.flop_counter` (forward and
  backward of one small batch), with the FLOPs of masked layers scaled by their density.
* :class:`StepLosses` — a fit's sample-weighted training loss, kept per step and summed once when the fit ends.

Per-client accuracies are simple correct/total counts accumulated by the loop; torchmetrics' class-based metrics
would add a per-client object and a host sync per batch for the same number.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch  # noqa: F401 - used by the doctests
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from pl_fedsparse.executors.compiling import outside_graphs

__all__ = ["summarize_accuracies", "summarize_metric", "EVAL_METRICS", "bottom_decile", "CommLedger", "TrainFlops",
           "Accounting", "SERVER", "StepLosses", "PendingMetric"]

SERVER = -1  #: node id of the server in :class:`CommLedger`


class StepLosses:
    """A fit's ``Σ loss_i · n_i`` (each step's loss times its batch size), kept per step and summed once, on the host,
    when the fit ends.

    Summed on the device at every step, the training loss costs two operators a step (the product and the sum: on
    a GPU two kernel launches, in a step of a few dozen). Kept as they are (0-dim tensors where the fit runs: no
    operator, no host sync), the losses are read in one copy at the end and added up in the order and with the
    rounding the per-step sum had, ``acc = acc + loss_i · n_i``: the product in the loss's dtype (``cast_float``:
    in float32, ``loss.float() · n``), ``acc`` a float32 that starts at 0 (``start_at_zero``) or at the first
    product. The same number, bit for bit (float32 losses are summed with numpy's float32 arithmetic, any other
    dtype with torch's operators on the host copies).

    Example:
        >>> s = StepLosses()
        >>> s.add(torch.tensor(0.5), 10); s.add(torch.tensor(0.25), 4)
        >>> s.total(), s.samples
        (6.0, 14)
    """

    def __init__(self, *, cast_float: bool = False, start_at_zero: bool = True, copy: bool = False) -> None:
        self.cast_float, self.start_at_zero = cast_float, start_at_zero
        #: keep a copy of each loss, made outside any compiled graph (one operator a step), instead of the loss
        #: itself: where the steps run as CUDA graphs (``trainer.compile: {mode: reduce-overhead}``), whose replays
        #: overwrite their outputs at the next step (:func:`~pl_fedsparse.executors.compiling.graph_outputs_reused`)
        self.copy = copy
        self.reset()

    def reset(self) -> None:
        """Forget the steps (a new fit)."""
        self._losses: list[Tensor] = []
        self._sizes: list[int] = []
        self.samples = 0

    def __len__(self) -> int:
        return len(self._losses)

    def add(self, loss: Tensor, n: int) -> None:
        """One step's loss (one value, any shape) and its batch size; no operator runs (one copy where
        :attr:`copy`)."""
        self._losses.append(outside_graphs(Tensor.clone, loss.detach()) if self.copy else loss.detach())
        self._sizes.append(int(n))
        self.samples += int(n)

    def total(self) -> float | None:
        """``Σ loss_i · n_i`` as a Python float (``None`` before any step), in one read of the losses."""
        if not self._losses:
            return None
        read = self.pending()
        if read is not None:
            stacked, total_of = read
            return total_of(stacked)
        losses = [t.reshape(()) for t in self._losses]
        host = [t.cpu() for t in losses]  # (a rare dtype: the same operators, on the host copies)
        total: Tensor | None = torch.zeros((), dtype=torch.float32) if self.start_at_zero else None
        for t, n in zip(host, self._sizes):
            p = (t.float() if self.cast_float else t) * n
            if total is None:
                total = p
            elif self.start_at_zero:
                total += p
            else:
                total = total + p
        assert total is not None
        return float(total)

    def pending(self) -> tuple[Tensor, Callable[[Tensor], float]] | None:
        """The losses as one float32 tensor where they are (stacked: no wait) and the function that makes
        :meth:`total`'s number from it (or from its host copy) — so that the read can go with another copy
        (:meth:`~pl_fedsparse.client.ClientUpdate.on_host`). ``None`` before any step and where the losses are not
        all exactly float32 (a rare dtype: :meth:`total` reads them its own way)."""
        if not self._losses:
            return None
        losses = [t.reshape(()) for t in self._losses]
        dtypes = {t.dtype for t in losses}
        if not (len(dtypes) == 1 and (self.cast_float or dtypes == {torch.float32})
                and dtypes <= {torch.float32, torch.float16, torch.bfloat16}):
            return None
        sizes, start_at_zero = list(self._sizes), self.start_at_zero

        def total_of(stacked: Tensor) -> float:
            # every loss exactly a float32 (a float16/bfloat16 one too): numpy's float32 products and sums round as
            # the device's did (each step's product, then its sum, both rounded to float32)
            acc = np.float32(0.0) if start_at_zero else None
            with np.errstate(over="ignore", invalid="ignore"):  # (inf and NaN as the device makes them, silently)
                for v, n in zip(stacked.tolist(), sizes):
                    p = np.float32(v) * np.float32(n)
                    acc = p if acc is None else np.float32(acc + p)
            return float(acc)  # type: ignore[arg-type]

        return torch.stack(losses).float(), total_of

    def metrics(self) -> dict[str, float]:
        """``{"train_loss": Σ loss_i · n_i / Σ n_i, "samples_seen": Σ n_i}`` of the fit (NaN loss without samples)."""
        return {"train_loss": mean_loss(self.total(), self.samples), "samples_seen": float(self.samples)}

    def metrics_on_host(self, update: Any) -> dict[str, float | PendingMetric]:
        """:meth:`metrics` with the loss read when ``update`` crosses to the host, in its copy
        (:meth:`~pl_fedsparse.client.ClientUpdate.on_host`): until then ``train_loss`` is a :class:`PendingMetric`.
        The same numbers as :meth:`metrics`. Returns the dict to hand to the update (it fills it in)."""
        read = self.pending()
        if read is None:
            return dict(self.metrics())
        n = self.samples
        stacked, total_of = read
        out: dict[str, float | PendingMetric] = {"train_loss": PendingMetric("train_loss"), "samples_seen": float(n)}

        def fill(host: list[Tensor]) -> None:
            out["train_loss"] = mean_loss(total_of(host[0]), n)

        update.on_host([stacked], fill)
        return out


def mean_loss(total: float | None, samples: int) -> float:
    """A fit's ``train_loss``: its loss sum over its samples (NaN without a step or a sample)."""
    return total / samples if (total is not None and samples) else float("nan")


class PendingMetric:
    """A fit's metric not read yet: it is read when the update crosses to the host, with it (a device would
    otherwise make the host wait for the whole fit to read it). What ``update.metrics`` holds in its place during
    ``on_client_fit_end`` where every callback takes the update on the device
    (:attr:`~pl_fedsparse.callbacks.FederatedCallback.device_update`); a number once the fit has ended."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: read when the fit ends>"

    def _refuse(self, *_: Any) -> Any:
        raise TypeError(f"update.metrics[{self.name!r}] is read when the fit ends (with the update's copy to the "
                        "host); in on_client_fit_end of a callback with device_update = True it is not a number yet "
                        "— read it in on_before_aggregate, or leave device_update False")

    __float__ = __int__ = __bool__ = __index__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse


def bottom_decile(values: Sequence[float]) -> float:
    """The ``⌊N/10⌋``-th smallest value (0-based), pFedGate/FedEM's "bottom decile" accuracy.

    Example:
        >>> bottom_decile([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 1.0])  # N=10 -> index 1 -> 2nd worst
        0.2
        >>> bottom_decile([0.3, 0.2])  # N < 10 -> the worst
        0.2
    """
    if len(values) == 0:
        return float("nan")
    return float(np.sort(np.asarray(values, dtype=np.float64))[len(values) // 10])


def summarize_accuracies(accs: Sequence[float], n_samples: Sequence[int]) -> dict[str, float]:
    """Federation-level accuracy statistics from per-client accuracies.

    Args:
        accs: accuracy of each client's model on its own test data.
        n_samples: each client's number of test samples (weights of the weighted mean).

    Returns:
        ``acc_mean`` (unweighted over clients), ``acc_weighted`` (by test samples), ``acc_std`` (population std over
        clients) and ``acc_bottom10`` (:func:`bottom_decile`).

    Example:
        >>> s = summarize_accuracies([1.0, 0.5], [1, 3])
        >>> s["acc_mean"], s["acc_weighted"], s["acc_std"], s["acc_bottom10"]
        (0.75, 0.625, 0.25, 0.5)
    """
    a = np.asarray(accs, dtype=np.float64)
    n = np.asarray(n_samples, dtype=np.float64)
    if a.size == 0:
        nan = float("nan")
        return {"acc_mean": nan, "acc_weighted": nan, "acc_std": nan, "acc_bottom10": nan}
    return {
        "acc_mean": float(a.mean()),
        "acc_weighted": float((a * n).sum() / n.sum()) if n.sum() > 0 else float("nan"),
        "acc_std": float(a.std()),
        "acc_bottom10": bottom_decile(a.tolist()),
    }


#: per-client evaluation metrics beyond accuracy (``trainer.eval_metrics``): name -> whether higher is better
EVAL_METRICS: dict[str, bool] = {"f1_macro": True, "ece": False}


def summarize_metric(name: str, values: Sequence[float], n_samples: Sequence[int]) -> dict[str, float]:
    """Federation-level statistics of a per-client metric, named like the accuracy's: ``<name>_mean``,
    ``<name>_weighted`` (by test samples), ``<name>_std`` and the worst decile as :func:`bottom_decile` counts it
    for accuracy — ``<name>_bottom10`` when higher is better (F1), ``<name>_top10`` (the ``⌊N/10⌋``-th largest)
    when lower is better (calibration error).

    Example:
        >>> s = summarize_metric("ece", [0.1, 0.3], [1, 1])
        >>> s["ece_mean"], s["ece_weighted"], s["ece_top10"]
        (0.2, 0.2, 0.3)
    """
    higher = EVAL_METRICS[name]
    if not values:
        nan = float("nan")
        return {f"{name}_mean": nan, f"{name}_weighted": nan, f"{name}_std": nan,
                f"{name}_{'bottom10' if higher else 'top10'}": nan}
    s = summarize_accuracies(values if higher else [-v for v in values], n_samples)
    sign = 1.0 if higher else -1.0
    return {f"{name}_mean": sign * s["acc_mean"], f"{name}_weighted": sign * s["acc_weighted"],
            f"{name}_std": s["acc_std"], f"{name}_{'bottom10' if higher else 'top10'}": sign * s["acc_bottom10"]}


class CommLedger:
    """Bytes sent over every link, per round and cumulative.

    ``up`` counts bytes sent by clients (to the server or to peers), ``down`` bytes received by clients (from the
    server or from peers) and ``total`` every transfer once: in a star federation ``total = up + down``; between
    peers each transfer is both a send and a receive, so ``up = down = total``. A node's traffic is what it sends
    plus what it receives; the busiest node is the one with the most (its in- and out-traffic are also reported
    separately: the largest receive and the largest send volume of any node in the round). ``comm_links`` counts the
    transfers of a round and ``comm_bytes_per_link`` is their mean size.

    Example:
        >>> led = CommLedger()
        >>> led.record(SERVER, 0, 100); led.record(0, SERVER, 40); led.record(SERVER, 1, 100)
        >>> r = led.end_round()
        >>> r["comm_bytes_up"], r["comm_bytes_down"], r["comm_bytes_total"], r["comm_busiest_node_bytes"]
        (40, 200, 240, 240)
    """

    def __init__(self) -> None:
        self.cum = {"up": 0, "down": 0, "total": 0, "links": 0}
        self.cum_node: dict[int, int] = defaultdict(int)
        self._round = {"up": 0, "down": 0, "total": 0, "links": 0}
        self._round_node: dict[int, int] = defaultdict(int)
        self._round_in: dict[int, int] = defaultdict(int)
        self._round_out: dict[int, int] = defaultdict(int)

    def record(self, src: int, dst: int, nbytes: int) -> None:
        """Record ``nbytes`` sent from node ``src`` to node ``dst`` (:data:`SERVER` for the server) over one link."""
        if nbytes <= 0:
            return
        if src != SERVER:
            self._round["up"] += nbytes
        if dst != SERVER:
            self._round["down"] += nbytes
        self._round["total"] += nbytes
        self._round["links"] += 1
        self._round_node[src] += nbytes
        self._round_node[dst] += nbytes
        self._round_out[src] += nbytes
        self._round_in[dst] += nbytes

    def end_round(self) -> dict[str, float]:
        """Close the round: fold it into the totals and return the round's and the cumulative figures."""
        for k, v in self._round.items():
            self.cum[k] += v
        for node, v in self._round_node.items():
            self.cum_node[node] += v
        busiest_round = max(self._round_node.values(), default=0)
        clients_round = [v for n, v in self._round_node.items() if n != SERVER]
        out = {
            "comm_bytes_up": self._round["up"],
            "comm_bytes_down": self._round["down"],
            "comm_bytes_total": self._round["total"],
            "comm_links": self._round["links"],
            "comm_bytes_per_link": self._round["total"] / self._round["links"] if self._round["links"] else 0.0,
            "comm_busiest_node_bytes": busiest_round,
            "comm_busiest_node_in_bytes": max(self._round_in.values(), default=0),
            "comm_busiest_node_out_bytes": max(self._round_out.values(), default=0),
            "comm_busiest_client_bytes": max(clients_round, default=0),
            "comm_cum_bytes_up": self.cum["up"],
            "comm_cum_bytes_down": self.cum["down"],
            "comm_cum_bytes_total": self.cum["total"],
            "comm_cum_busiest_node_bytes": max(self.cum_node.values(), default=0),
            "comm_cum_busiest_client_bytes": max((v for n, v in self.cum_node.items() if n != SERVER), default=0),
        }
        self._round = {"up": 0, "down": 0, "total": 0, "links": 0}
        self._round_node, self._round_in, self._round_out = defaultdict(int), defaultdict(int), defaultdict(int)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"cum": dict(self.cum), "cum_node": dict(self.cum_node)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cum = {"links": 0, **{k: int(v) for k, v in state["cum"].items()}}
        self.cum_node = defaultdict(int, {int(k): int(v) for k, v in state["cum_node"].items()})


class TrainFlops:
    """Training FLOPs per sample (forward + backward) of a module, measured once with ``FlopCounterMode``.

    Layers whose weight is masked are charged in proportion to the mask's density: a layer's FLOPs are multiplied
    by ``nnz(mask) / numel(mask)`` of its ``weight`` (theoretical sparse FLOPs, as the DisPFL/FedSpa papers report;
    real dense kernels do not get faster). Elementwise ops, norms and pooling are not counted by the flop counter,
    matching the papers' conv/linear-only counts.

    Args:
        module: the model (its forward takes the example input).
        example: a small input batch (on the module's device).
        loss_fn: maps the output to a scalar to backpropagate (default: ``out.float().sum()``).

    Example:
        >>> net = nn.Linear(4, 3, bias=False)
        >>> tf = TrainFlops(net, torch.zeros(2, 4))
        >>> tf.per_sample()  # forward 2·4·3 + backward (grad w.r.t. weight) 2·4·3; no input grad needed
        48.0
        >>> tf.per_sample({"weight": 0.5})
        24.0
    """

    def __init__(self, module: nn.Module, example: Tensor, loss_fn: Any = None) -> None:
        batch = int(example.shape[0])
        was_training = module.training
        module.train()
        saved = [(p, None if p.grad is None else p.grad.clone()) for p in module.parameters()]
        with FlopCounterMode(display=False) as counter:
            out = module(example)
            loss = out.float().sum() if loss_fn is None else loss_fn(out)
            loss.backward()
        for p, g in saved:
            p.grad = g
        module.train(was_training)
        self.total = counter.get_total_flops() / batch
        counts = counter.get_flop_counts()
        # FLOPs of each leaf module that owns a "weight", keyed by that weight's name in module.state_dict()
        root = type(module).__name__
        self.layer_flops: dict[str, float] = {}
        for name, sub in module.named_modules():
            if isinstance(getattr(sub, "weight", None), Tensor) and not list(sub.children()):
                key = f"{root}.{name}" if name else root
                if key in counts:
                    self.layer_flops[f"{name}.weight" if name else "weight"] = sum(counts[key].values()) / batch

    def per_sample(self, densities: Mapping[str, float] | None = None) -> float:
        """FLOPs to train on one sample, with masked layers scaled by ``densities`` (weight name -> density)."""
        if not densities:
            return float(self.total)
        saved = sum((1.0 - densities[k]) * f for k, f in self.layer_flops.items() if k in densities)
        return float(self.total - saved)

    @staticmethod
    def densities(masks: Mapping[str, Tensor] | None) -> dict[str, float]:
        """Density of every mask (name -> nnz/numel)."""
        if not masks:
            return {}
        return {k: float(m.count_nonzero()) / max(m.numel(), 1) for k, m in masks.items()}


class Accounting:
    """Traffic and training compute of a federation: the one place where both are charged.

    The loop charges a round's messages and every fit's training; callbacks charge what they cause besides
    (e.g. the download of a fine-tuning start, a gradient pass for regrowth or for an initial mask's scores) with
    :meth:`send` and :meth:`charge_flops` — usually through ``loop.accounting``.

    Example:
        >>> acc = Accounting()
        >>> acc.send(SERVER, 0, 100); acc.charge_flops(0, 5.0); acc.charge_flops(1, 7.0)
        >>> row = acc.end_round(participants=2)
        >>> row["comm_bytes_down"], row["flops_train"], row["flops_train_per_client"], acc.client_flops
        (100, 12.0, 6.0, {0: 5.0, 1: 7.0})
    """

    def __init__(self, train_flops: TrainFlops | None = None) -> None:
        self.comm = CommLedger()
        self.train_flops = train_flops
        self.flops_cum = 0.0
        self.client_flops: dict[int, float] = {}
        self.round_flops = 0.0

    def send(self, src: int, dst: int, message: Any) -> None:
        """Charge one transfer from node ``src`` to ``dst`` (:data:`SERVER` for the server): a
        :class:`~pl_fedsparse.client.Message` (its :meth:`nbytes`) or a byte count."""
        self.comm.record(src, dst, int(message) if isinstance(message, (int, np.integer)) else message.nbytes())

    def charge_flops(self, client_idx: int, flops: float, update: Any = None) -> None:
        """Charge ``flops`` of training compute to ``client_idx``.

        With an ``update`` (compute spent during that client's fit, e.g. a gradient pass for regrowth), the charge
        is added to ``update.flops`` and booked when the update reaches the loop (:meth:`book`) — so a fit that ran
        in another process is charged the same way. Without one it is booked now."""
        if update is not None:
            update.flops += flops
            update.flop_charges.append(flops)
            return
        self._book(client_idx, flops)

    def book(self, update: Any) -> None:
        """Book the charges made during one fit (in the order they were made)."""
        for flops in update.flop_charges:
            self._book(update.client_idx, flops)
        update.flop_charges = []

    def _book(self, client_idx: int, flops: float) -> None:
        self.flops_cum += flops
        self.client_flops[client_idx] = self.client_flops.get(client_idx, 0.0) + flops
        self.round_flops += flops

    def flops_per_sample(self, masks: Mapping[str, Tensor] | None = None) -> float:
        """Training FLOPs of one sample, masked layers at their masks' density (dense without masks)."""
        if self.train_flops is None:
            return 0.0
        return self.train_flops.per_sample(TrainFlops.densities(masks))

    def charge_training(self, update: Any, samples: float) -> None:
        """Charge a fit that trained on ``samples`` samples under ``update.masks``."""
        self.charge_flops(update.client_idx, samples * self.flops_per_sample(update.masks), update)

    def start_round(self) -> None:
        self.round_flops = 0.0

    def end_round(self, participants: int) -> dict[str, Any]:
        """The round's traffic and compute figures (then the next round starts from zero)."""
        row: dict[str, Any] = dict(self.comm.end_round())
        row["flops_train"] = self.round_flops
        row["flops_train_per_client"] = self.round_flops / max(participants, 1)
        row["flops_train_cum"] = self.flops_cum
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"comm": self.comm.state_dict(), "flops_cum": self.flops_cum, "client_flops": dict(self.client_flops)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.comm.load_state_dict(state["comm"])
        self.flops_cum = float(state["flops_cum"])
        self.client_flops = {int(k): float(v) for k, v in state["client_flops"].items()}
