"""``torch.compile`` for the clients' fits: ``trainer.compile`` and a module the user compiled themselves.

Most tests compile with the ``eager`` backend (dynamo captures the graphs and runs them with torch's own operators:
the same arithmetic, bit for bit, in milliseconds instead of the C++ build of the default backend), so they check
the plumbing — what is compiled, where, how often, what travels to another process — and that the numbers are the
uncompiled run's. One slow test runs the default backend (inductor) end to end.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import METHODS, fit_until_interrupted, one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse.errors import ConfigError, RunStoppedError
from pl_fedsparse.executors import VectorizedExecutor
from pl_fedsparse.executors.compiling import (
    check_compile,
    compile_module,
    graph_outputs_reused,
    is_compiled,
    running_uncompiled,
    uncompiled_copy,
    unwrap_compiled,
)
from pl_fedsparse.callbacks import FineTune
from pl_fedsparse.models import MLP
from pl_fedsparse.testing import SIMULATED_CUDA_GRAPHS, simulated_cuda_graphs

EAGER = {"backend": "eager"}
IGNORED = ("time_s", "time_cum_s", "time_train_s")


def _rows(loop: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in IGNORED} for row in loop.history]


def _mixture() -> Any:
    """FedEM's module: the tiny task's MLP as a mixture of three components."""
    from pl_fedsparse import FederatedModule
    from pl_fedsparse.models import Mixture

    torch.manual_seed(0)
    return FederatedModule(Mixture(MLP(num_classes=4, in_channels=1, input_size=8, hidden=[16]), 3), lr=0.1)


def _more() -> dict[str, Any]:
    """Methods beyond the tiny task's (``conftest.METHODS``): FedPSE, DM-PFL+, FedRep (two local epochs)."""
    from pl_fedsparse import callbacks as C

    return {"fedpse": (lambda: [C.TopKUpload(sparsity=0.5), C.ElementwiseAggregation(),
                                C.PersonalizedDownstream(sparsity=0.5)], {}),
            "dmpfl_plus": (lambda: [C.DualMask(density=0.5, iterations=1), C.AdaptiveInference()], {}),
            "fedrep": (lambda: [C.PersonalLayers(head_epochs=1)], {"local_epochs": 2})}


def _run(tmp_path: Path, method: str, model: Any = None, **kw: Any) -> Any:
    if method == "fedem":  # (not among the tiny task's methods: its module is a mixture)
        from pl_fedsparse.callbacks import FedEM

        callbacks, topology, model = [FedEM()], None, model if model is not None else _mixture()
    elif (more := _more().get(method)) is not None:
        make, extra = more
        callbacks, topology = make(), None
        kw = {**extra, **kw}
    else:
        make, topo = METHODS[method]
        callbacks, topology = make(), topo() if topo else None
    loop = tiny_loop(tmp_path, callbacks=callbacks, topology=topology, **kw)
    loop.fit(model if model is not None else tiny_module(), tiny_datamodule())
    return loop


def _extending_example(cls: str) -> dict[str, Any]:
    """The names docs/extending.md's code block defining ``cls`` makes, run as written."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    start = text.index(f"class {cls}(FederatedCallback):")
    code = text[text.rindex("```python", 0, start) + len("```python"):text.index("```", start)]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/extending.md", "exec"), namespace)
    return namespace


def _graphs() -> int:
    """Graphs dynamo has compiled in this process since its last reset."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _reset() -> None:
    """Dynamo's caches and counters emptied (``reset`` leaves the counters)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    _reset()
    yield
    _reset()


# ------------------------------------------------------------------------------------------------ the setting
@pytest.mark.parametrize("value, expected", [(False, None), (None, None), (True, {}),
                                             ({"mode": "default", "dynamic": False}, {"mode": "default",
                                                                                      "dynamic": False}),
                                             ({"backend": "eager", "fullgraph": True},
                                              {"backend": "eager", "fullgraph": True}),
                                             ({"mode": "reduce-overhead"}, {"mode": "reduce-overhead"}),
                                             ({"options": {"triton.cudagraphs": True}},
                                              {"options": {"triton.cudagraphs": True}}),
                                             ({"backend": "cudagraphs"}, {"backend": "cudagraphs"})])
def test_the_setting_becomes_torch_compiles_arguments(value: Any, expected: Any) -> None:
    assert check_compile(value) == expected


@pytest.mark.parametrize("value, names", [
    ("yes", "trainer.compile='yes' is invalid: expected true, false or a mapping"),
    ({"modes": "default"}, "got 'modes'"),
    ({"mode": "fastest"}, "trainer.compile.mode='fastest' is invalid: expected one of default, reduce-overhead, "
                          "max-autotune, max-autotune-no-cudagraphs"),
    ({"fullgraph": "yes"}, "trainer.compile.fullgraph='yes' is invalid: expected true or false"),
    ({"dynamic": 1}, "trainer.compile.dynamic=1 is invalid"),
    ({"backend": "no_such_backend"}, "trainer.compile.backend='no_such_backend' is invalid: expected one of"),
    ({"options": {}, "mode": "default"}, "mode or options, not both"),
])
def test_a_bad_setting_is_one_line_naming_it(value: Any, names: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_compile(value)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_a_bad_setting_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", "--config", "configs/quickstart.yaml", "--trainer.default_root_dir",
                             str(tmp_path), "--trainer.compile", "{mode: fastest}"], capsys)
    assert code != 0
    assert "trainer.compile.mode='fastest' is invalid" in one_line(err)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("setting, reused", [
    ({"mode": "reduce-overhead"}, True), ({"mode": "max-autotune"}, True), ({"backend": "cudagraphs"}, True),
    ({"options": {"triton.cudagraphs": True}}, True), ({}, False), ({"mode": "max-autotune-no-cudagraphs"}, False),
    ({"backend": "eager"}, False), ({"options": {"max_autotune": True}}, False)])
@pytest.mark.parametrize("how", ["setting", "wrapped"])
def test_cuda_graph_settings_are_told_from_the_compiled_module(setting: dict[str, Any], reused: bool,
                                                               how: str) -> None:
    """What makes the fits keep copies of a step's outputs (CUDA graphs overwrite them at the next step): the
    setting, or the ``torch.compile`` wrapper the user passed (nothing is compiled until a call)."""
    module = tiny_module()
    assert not graph_outputs_reused(module)
    if how == "setting":
        compile_module(module, setting)
    else:
        inner, wrapper = unwrap_compiled(torch.compile(module, **setting))
        compile_module(inner, None, wrapper)
    assert graph_outputs_reused(module) is reused


# ------------------------------------------------------------------------------------------------ in process
@pytest.mark.parametrize("method", ["fedspa", "pfedgate", *(pytest.param(m, marks=pytest.mark.slow)
                                                           for m in ("fedem", "dispfl"))])
def test_compiled_fits_give_the_uncompiled_numbers(tmp_path: Path, method: str) -> None:
    """The ``eager`` backend runs the captured graphs with torch's operators: the same bits, so any difference
    is the engine's (a fit that lost its mask, a state loaded into other tensors than the graphs read). pFedGate
    and FedEM put their own ``forward`` in the module during fits: the compiled training step runs it."""
    ref = _run(tmp_path / "ref", method)
    got = _run(tmp_path / "compiled", method, compile=EAGER)
    assert is_compiled(got.model) and not is_compiled(ref.model)
    assert _rows(got) == _rows(ref)


@pytest.mark.parametrize("method", ["fedem", pytest.param("pfedgate", marks=pytest.mark.slow)])
def test_autograd_compiled_steps_train_the_methods_that_replace_the_forward(tmp_path: Path, method: str) -> None:
    """``aot_eager``: AOTAutograd's one autograd node per compiled graph (inductor's too), with torch's operators.
    FedEM's running sum of responsibilities, carried from step to step, must not join one step's graph to the
    last one's (it did: "backward through the graph a second time" in every fit)."""
    ref = _run(tmp_path / "ref", method, num_rounds=2)
    got = _run(tmp_path / "compiled", method, num_rounds=2, compile={"backend": "aot_eager"})
    assert all(row["client_faults"] == 0 for row in got.history)
    for a, b in zip(_rows(ref), _rows(got), strict=True):
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-7) if isinstance(v, float) else b[k] == v, k


def test_the_simulation_finds_a_gradient_read_after_the_next_step_began(tmp_path: Path) -> None:
    """Gradients a compiled backward made live in the graphs' memory too: read once the next step's forward has run
    (``on_before_zero_grad`` sees the last step's gradients), they are overwritten — on a GPU torch raises."""
    import lightning.pytorch as pl

    class GradSum(pl.Callback):
        scratch_attributes = ("sums",)

        def __init__(self) -> None:
            self.sums: list[float] = []

        def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            if grads:
                self.sums.append(float(sum(g.sum() for g in grads)))

    def sums(name: str, setting: Any) -> list[float]:
        cb = GradSum()
        loop = tiny_loop(tmp_path / name, callbacks=[FineTune(epochs=1), cb], compile=setting, num_rounds=1)
        with simulated_cuda_graphs():
            loop.fit(tiny_module(), tiny_datamodule())
        return cb.sums

    ref = sums("ref", None)
    assert ref and all(t == t for t in ref)
    assert sums("eager", EAGER) == ref
    assert all(t != t for t in sums("graphs", {"backend": SIMULATED_CUDA_GRAPHS}))


@pytest.mark.parametrize("method, fit_runner", [
    ("fedspa", "auto"), ("pfedgate", "auto"), ("fedem", "auto"),
    *(pytest.param(m, "auto", marks=pytest.mark.slow)
      for m in ("fedavg_ft", "dispfl", "dmpfl", "ditto_masked", "fedpse", "dmpfl_plus", "fedrep")),
    pytest.param("fedspa", "trainer", marks=pytest.mark.slow), pytest.param("pfedgate", "trainer",
                                                                            marks=pytest.mark.slow)])
def test_every_method_under_cuda_graphs_gives_the_uncompiled_numbers(tmp_path: Path, method: str,
                                                                     fit_runner: str) -> None:
    """CUDA graphs overwrite a compiled step's outputs when the next step begins (simulated on the CPU: outputs of
    earlier generations turned to NaN). What the engine and the methods keep past a step — each step's loss for the
    fit's mean, pFedGate's statistics of kept blocks, FedEM's running sum of responsibilities, the evaluation's
    logits batch after batch — are copies made outside the graphs: the uncompiled numbers, bit for bit."""
    ref = _run(tmp_path / "ref", method, fit_runner=fit_runner)
    with simulated_cuda_graphs() as runs:
        got = _run(tmp_path / "graphs", method, fit_runner=fit_runner, compile={"backend": SIMULATED_CUDA_GRAPHS})
    assert graph_outputs_reused(got.model)
    assert runs.generations > 20 and runs.overwritten > 0  # (outputs were overwritten: the simulation bit)
    assert _rows(got) == _rows(ref)


def test_the_simulation_finds_a_loss_kept_without_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulated CUDA graphs can tell: the module's step losses kept as the steps gave them (no copy) are read
    overwritten, and every fit's training loss is NaN (the fault policy skips them; the run stops)."""
    import pl_fedsparse.module as module

    monkeypatch.setattr(module, "graph_outputs_reused", lambda m: False)
    with simulated_cuda_graphs(), pytest.raises(RunStoppedError, match="nonfinite_loss"):
        _run(tmp_path, "fedspa", compile={"backend": SIMULATED_CUDA_GRAPHS})


@pytest.mark.parametrize("method, fit_runner", [
    ("fedspa", "auto"), ("pfedgate", "auto"),
    *(pytest.param(m, "auto", marks=pytest.mark.slow) for m in ("fedem", "dispfl", "dmpfl", "ditto_masked")),
    pytest.param("fedspa", "trainer", marks=pytest.mark.slow)])
def test_a_federation_compiles_once_not_per_fit_and_without_a_graph_break(
        tmp_path: Path, method: str, fit_runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every client's fit reuses the one compiled module: the graphs of two rounds are those of four (a
    recompilation per client, or per fit, would add graphs with the rounds) — also where a callback puts its own
    ``forward`` in the module for each fit (the same bound method each time: the graphs are guarded on it).
    Dynamo's limit of recompilations per function is raised well above the fits, so that it does not hide them.

    And every method's compiled step is whole graphs, with no break: a break splits the step's kernels into pieces
    with Python between them, and most breaks read a tensor on the host (a wait for the GPU). pFedGate with its
    knapsack where the gate is, as on a GPU (on the CPU it solves it on the host, by design a break)."""
    from torch._dynamo.utils import counters

    import pl_fedsparse.functional.gate as gate

    monkeypatch.setattr(gate, "HOST_KNAPSACK_ON_CPU", False)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
        _run(tmp_path / "two", method, compile=EAGER, num_rounds=2, fit_runner=fit_runner)
        two = _graphs()
        _reset()
        _run(tmp_path / "four", method, compile=EAGER, num_rounds=4, fit_runner=fit_runner)
    assert two > 0 and _graphs() == two
    assert dict(counters["graph_break"]) == {}


@pytest.mark.parametrize("method", ["pfedgate", pytest.param("fedem", marks=pytest.mark.slow)])
def test_a_callbacks_own_forward_gives_the_compiled_one_back(tmp_path: Path, method: str) -> None:
    """The forward a callback installs for a fit (or a personal evaluation) shadows the compiled one, which is
    the module's again after it: later evaluations and fits find the module as compiled."""
    module = tiny_module() if method != "fedem" else _mixture()
    compile_module(module, EAGER)
    compiled = dict(vars(module))
    loop = _run(tmp_path, method, model=module, compile=EAGER, num_rounds=2)
    assert loop.model is module
    for name in ("forward", "training_step", "loss"):
        assert vars(module).get(name) is compiled.get(name), name


def test_the_module_torch_compile_returned_is_taken_as_trainer_fit_takes_it(tmp_path: Path) -> None:
    ref = _run(tmp_path / "ref", "fedavg_ft")
    module = tiny_module()
    got = _run(tmp_path / "wrapped", "fedavg_ft", model=torch.compile(module, backend="eager"))
    assert got.model is module and is_compiled(module)  # the module inside, compiled in place (same names)
    assert _graphs() > 0 and _rows(got) == _rows(ref)
    assert list(got.initial_state) == list(tiny_module().state_dict())


def test_a_compiled_plain_module_is_refused_in_one_line(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path)
    with pytest.raises(ConfigError, match=r"model=torch.compile\(MLP\) is invalid: expected a compiled "
                                          r"lightning.pytorch.LightningModule"):
        loop.fit(torch.compile(MLP(num_classes=4, in_channels=1, input_size=8)), tiny_datamodule())


def test_the_docs_example_of_a_callbacks_own_forward_runs_compiled_once(tmp_path: Path) -> None:
    """docs/extending.md's ``MyForward`` (its code block, run as written): trained with a compiled module, it
    compiles no more graphs in four rounds than in two, and gives the compiled forward back."""
    namespace = _extending_example("MyForward")
    graphs = []
    for rounds in (2, 4):
        _reset()
        module = tiny_module()
        compile_module(module, EAGER)
        compiled = vars(module)["forward"]
        loop = tiny_loop(tmp_path / str(rounds), callbacks=[namespace["MyForward"]()], compile=EAGER,
                         num_rounds=rounds)
        with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=1024):
            loop.fit(module, tiny_datamodule())
        assert vars(module)["forward"] is compiled and loop.history[-1]["client_faults"] == 0
        graphs.append(_graphs())
    assert graphs[0] > 0 and graphs[1] == graphs[0]


def test_the_docs_example_of_a_running_sum_keeps_it_under_cuda_graphs(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/extending.md's ``LogitSum`` (run as written): the sums of its fits uncompiled, compiled, and compiled as
    (simulated) CUDA graphs are the same; kept in the graph under CUDA graphs, they are read overwritten (NaN)."""
    namespace = _extending_example("LogitSum")

    def totals(name: str, setting: Any) -> list[float]:
        cb = namespace["LogitSum"]()
        loop = tiny_loop(tmp_path / name, callbacks=[cb], compile=setting)
        with simulated_cuda_graphs():
            loop.fit(tiny_module(), tiny_datamodule())
        return cb.totals

    ref = totals("ref", None)
    assert len(ref) == 8 and all(t == t for t in ref)  # (2 rounds x 4 clients, none NaN)
    assert totals("eager", EAGER) == ref
    graphs = {"backend": SIMULATED_CUDA_GRAPHS}
    assert totals("graphs", graphs) == ref
    monkeypatch.setitem(namespace, "graph_outputs_reused", lambda module: False)  # kept in the graph
    assert all(t != t for t in totals("kept", graphs))


@pytest.mark.parametrize("how", ["setting", "wrapped"])
def test_a_callback_that_does_not_support_compilation_refuses_it_in_one_line(tmp_path: Path, how: str) -> None:
    """A callback says it cannot run with a compiled module by ``supports_compile = False``: refused before
    anything runs. The library's own callbacks all can (pFedGate and FedEM too: above)."""
    from pl_fedsparse import FederatedCallback
    from pl_fedsparse.callbacks import FedEM, PFedGate

    class Mine(FederatedCallback):
        supports_compile = False

    loop = tiny_loop(tmp_path, callbacks=[Mine()], compile=True if how == "setting" else False)
    model = tiny_module() if how == "setting" else torch.compile(tiny_module(), backend="eager")
    what = "trainer.compile=True" if how == "setting" else r"model=torch.compile\(...\)"
    with pytest.raises(ConfigError, match=f"^{what} is invalid with Mine: expected the module uncompiled"):
        loop.fit(model, tiny_datamodule())
    assert not (tmp_path / "metrics.jsonl").exists()
    assert PFedGate.supports_compile and FedEM.supports_compile


def test_without_the_setting_nothing_is_compiled(tmp_path: Path) -> None:
    loop = _run(tmp_path, "fedavg_ft")
    assert not is_compiled(loop.model) and _graphs() == 0


def test_a_resume_may_turn_compilation_on(tmp_path: Path) -> None:
    """The compiled module keeps its parameter names: a checkpoint of an uncompiled run resumes compiled (and the
    rounds after it are the uncompiled run's, the eager backend's arithmetic being torch's own)."""
    full = _run(tmp_path / "full", "fedspa", num_rounds=3)
    make, _ = METHODS["fedspa"]
    cut = tiny_loop(tmp_path / "cut", num_rounds=3, callbacks=make())
    fit_until_interrupted(cut, 2, tiny_module(), tiny_datamodule())
    resumed = tiny_loop(tmp_path / "cut", num_rounds=3, callbacks=make(), compile=EAGER)
    resumed.fit(tiny_module(seed=1), tiny_datamodule(), ckpt_path=str(tmp_path / "cut" / "checkpoints" / "last.ckpt"))
    assert is_compiled(resumed.model) and _graphs() > 0
    assert _rows(resumed) == _rows(full)


# ------------------------------------------------------------------------------------------------ the helpers
def test_compiling_replaces_the_methods_in_place_and_a_copy_undoes_it() -> None:
    module = tiny_module()
    own = type(module).forward
    assert not compile_module(module, None)  # (off: nothing)
    assert compile_module(module, EAGER) and is_compiled(module)
    assert "forward" in vars(module) and "training_step" in vars(module)
    copy = uncompiled_copy(module)
    assert not is_compiled(copy) and "forward" not in vars(copy) and is_compiled(module)
    assert copy.backbone is module.backbone  # (the same parameters: nothing is copied but the methods' table)
    back = pickle.loads(pickle.dumps(copy))
    assert type(back).forward is own and not is_compiled(back)
    with running_uncompiled(module):
        assert "forward" not in vars(module)
    assert is_compiled(module) and "forward" in vars(module)
    inner = tiny_module()
    assert uncompiled_copy(inner) is inner and unwrap_compiled(inner) == (inner, None)  # (uncompiled: as it is)


def test_a_compiled_module_is_left_as_it_is() -> None:
    module = tiny_module()
    compile_module(module, EAGER)
    forward = vars(module)["forward"]
    compile_module(module, {"backend": "aot_eager"})  # (a second setting changes nothing)
    assert vars(module)["forward"] is forward


# ------------------------------------------------------------------------------------------------ other executors
def test_stacked_fits_run_the_modules_own_forward_and_give_the_same_numbers(tmp_path: Path) -> None:
    """The VectorizedExecutor's stacked layers call the module under ``vmap``, where a compiled forward cannot
    run: it runs uncompiled there (the one-by-one fits, compiled), the same numbers."""
    ref = _run(tmp_path / "ref", "fedavg_ft", executor=VectorizedExecutor())
    got = _run(tmp_path / "compiled", "fedavg_ft", executor=VectorizedExecutor(), compile=EAGER)
    assert is_compiled(got.model) and _rows(got) == _rows(ref)


def test_ray_refuses_a_compiled_module_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from pl_fedsparse.executors import RayExecutor

    loop = tiny_loop(tmp_path, executor=RayExecutor(num_workers=1))
    with pytest.raises(ConfigError, match=r"model=torch.compile\(...\) is invalid with "
                                          r"trainer.executor=RayExecutor: expected the module uncompiled and "
                                          r"trainer.compile set"):
        loop.fit(torch.compile(tiny_module(), backend="eager"), tiny_datamodule())


def test_a_workers_copy_of_the_loop_travels_uncompiled_and_compiles_itself(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from pl_fedsparse.executors import FitWorker, worker_spec

    loop = tiny_loop(tmp_path, compile=EAGER)
    loop.setup(tiny_module(), tiny_datamodule())
    assert is_compiled(loop.model)
    spec = pickle.loads(pickle.dumps(worker_spec(loop)))  # (what Ray's object store carries)
    assert not is_compiled(spec["model"]) and is_compiled(loop.model)
    worker = FitWorker(spec)
    assert is_compiled(worker.loop.model)


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                    reason="inductor builds C++ on the CPU: no compiler here")
@pytest.mark.parametrize("method", ["fedspa", "pfedgate"])
def test_the_default_backend_trains_a_federation(tmp_path: Path, method: str) -> None:
    """Inductor (the default backend; a C++ build on the CPU) end to end: the numbers within float32 rounding of
    the uncompiled run's (fused kernels round differently)."""
    ref = _run(tmp_path / "ref", method)
    got = _run(tmp_path / "compiled", method, compile=True)
    assert is_compiled(got.model)
    for a, b in zip(_rows(ref), _rows(got), strict=True):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
            else:
                assert b[k] == v, k


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                    reason="inductor builds C++ on the CPU: no compiler here")
@pytest.mark.parametrize("lead", [(), (3,)])
def test_inductor_expands_block_weights_whose_last_block_is_shorter(lead: tuple[int, ...]) -> None:
    """pFedGate's ``θ' = θ ⊙ expand(M')`` where a parameter's last block is shorter than the others (1024 elements in
    5 blocks: 4 of 205 and 1 of 204), as one client and as stacked clients: compiled as uncompiled. Cut before the
    concatenation, inductor's C++ backend (torch 2.14.1) left that last block unwritten (its loop split cut 819
    elements into 3 x 205), and pFedGate's compiled fits trained on whatever the memory held."""
    from pl_fedsparse.functional.gate import make_block_table, personalized_params
    from pl_fedsparse.functional.gate_stacked import stacked_personalized_params

    table = make_block_table([("w", (16, 64), True), ("b", (16,), True)], num_splits=5)
    torch.manual_seed(0)
    m = torch.rand(*lead, table.num_blocks)
    params = {"w": torch.randn(*lead, 16, 64), "b": torch.randn(*lead, 16)}
    grad = {n: torch.randn(t.shape) for n, t in params.items()}

    def run(fn: Any) -> list[torch.Tensor]:
        mm = m.clone().requires_grad_()
        pp = {n: t.clone().requires_grad_() for n, t in params.items()}
        out = fn(pp, mm)
        torch.autograd.backward([out[n] for n in pp], [grad[n] for n in pp])
        return [out["w"].detach(), out["b"].detach(), mm.grad, pp["w"].grad, pp["b"].grad]

    def expand(pp: dict[str, torch.Tensor], mm: torch.Tensor) -> dict[str, torch.Tensor]:
        return (stacked_personalized_params if lead else personalized_params)(pp, mm, table)

    want = run(expand)
    got = run(torch.compile(expand))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("setting", [True, {"mode": "reduce-overhead"}], ids=["default", "cuda-graphs"])
@pytest.mark.parametrize("method", ["fedspa", "pfedgate"])
def test_compiled_fits_on_the_gpu_give_the_uncompiled_numbers(tmp_path: Path, method: str, setting: Any) -> None:
    """Inductor's kernels on CUDA (Triton) for FedSpa's and pFedGate's fits on the GPU: the same bytes and FLOPs as
    the uncompiled run on the GPU, its accuracies and losses within what the GPU-vs-CPU test allows. pFedGate's
    kept blocks follow its gate's scores, so another rounding may keep another block: its gate densities and bytes
    within 1 %. With CUDA graphs (``reduce-overhead``), each step's kernels replayed as one graph: what the fits
    keep of a step is copied before the next overwrites it (else torch raises or the numbers drift)."""
    ref = _run(tmp_path / "ref", method, accelerator="gpu")
    got = _run(tmp_path / "compiled", method, accelerator="gpu", compile=setting)
    assert is_compiled(got.model) and got.model.device.type == "cuda"
    approx = {"acc": dict(abs=0.03), "loss": dict(rel=0.03), "kept": dict(rel=0.01)}  # (as the GPU-vs-CPU test)
    for a, b in zip(_rows(ref), _rows(got), strict=True):
        assert a.keys() == b.keys() and b["client_faults"] == 0
        for k, v in a.items():
            kept = method == "pfedgate" and k.startswith(("gate_", "comm_"))
            kind = "acc" if "acc" in k else "loss" if "loss" in k else "kept" if kept else None
            if kind is None:
                assert b[k] == v, k  # (bytes, FLOPs, counts: the arithmetic's rounding does not reach them)
            else:
                assert b[k] == pytest.approx(v, **approx[kind]), k
