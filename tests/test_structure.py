"""The package's seams: no import cycles, one method table that everything reads, layouts and
proposers that meet the protocols the step relies on, and optional dependencies checked up front."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from batchspec import BatchspecError, EngineConfig, cli
from batchspec.cache import kv
from batchspec.core import methods
from batchspec.core.sequence import Sequence
from batchspec.layouts.base import Layout
from batchspec.layouts.padded import PaddedBatch
from batchspec.layouts.ragged import RaggedBatch
from batchspec.proposers.base import Proposer
from batchspec.proposers.draft import DraftProposer
from batchspec.proposers.ngram import NgramProposer
from batchspec.runners.baselines import BSPBatch, DSDBatch

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "batchspec"

#: The layers, bottom to top: a module imports only from its own layer or from one below it.
#: (Equal ranks are siblings that must not import each other.)
LAYERS = {
    "core": 0,
    "distributed": 1,
    "cache": 2,
    "models": 3,
    "layouts": 4,
    "proposers": 5,
    "policy": 6,
    "engine": 7,
    "runners": 8,
    "decoder": 9,
    "serving": 10,
    "tools": 10,
    "cli": 11,
    "replicas": 12,
    "__init__": 13,
}


def _name(path: pathlib.Path) -> str:
    """batchspec.x.y for src/batchspec/x/y.py (a package: its folder's name)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: pathlib.Path) -> set[str]:
    """Every package module `path` imports, wherever the import is written: at module level,
    inside functions, under `if TYPE_CHECKING:`; `from . import x` counts as importing x."""
    me = _name(path)
    here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = (
                node.module if node.level == 0 else ".".join(here[: len(here) - node.level + 1] + [node.module or ""])
            )
            base = base.rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != me}


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def test_the_import_graph_finds_deferred_and_type_checking_imports():
    assert "batchspec.serving.replicas" in GRAPH["batchspec.cli"]  # imported inside a function
    assert "batchspec.layouts.base" in GRAPH["batchspec.proposers.base"]
    assert "batchspec.core.config" in GRAPH["batchspec.core.sampling"]


def test_no_import_cycle_of_any_kind():
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path + [module])
        state[module] = "open"
        for dep in sorted(GRAPH[module]):
            visit(dep, path + [module])
        state[module] = "done"

    for module in sorted(GRAPH):
        visit(module, [])


def test_every_import_points_down_the_layers():
    assert {_layer(m) for m in MODULES} == set(LAYERS), "a folder or root module the layer table does not name"
    upward = [
        f"{module} -> {dep}"
        for module, deps in GRAPH.items()
        for dep in deps
        if _layer(dep) != _layer(module) and LAYERS[_layer(dep)] >= LAYERS[_layer(module)]
    ]
    assert not upward, "imports that do not point down: " + ", ".join(sorted(upward))
    assert GRAPH["batchspec.core.methods"] <= {"batchspec.core.errors"}  # the table: everyone may import it
    assert not any(m.startswith("batchspec.serving") for m in GRAPH["batchspec.engine.online"])  # no HTTP


def test_the_step_reads_and_probes_for_nothing():
    """decode_step stays a short list of calls, and no module on the step's path asks an object
    whether it has a member (capabilities are declared on Layout, Proposer and Speculation)."""
    step = MODULES["batchspec.engine.step"]
    (fn,) = [n for n in ast.parse(step.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "decode_step"]
    assert fn.end_lineno - fn.lineno + 1 <= 40
    for name in ("engine.step", "engine.verify", "engine.loop", "engine.admission", "policy.speculation"):
        calls = [
            n.func.id
            for n in ast.walk(ast.parse(MODULES[f"batchspec.{name}"].read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        ]
        assert not {"getattr", "hasattr"} & set(calls), name


def test_every_method_has_a_runner_and_the_cli_lists_the_table():
    for method in methods.METHODS.values():
        assert callable(method.run()), method.name
    parser = cli.build_parser()
    gen = parser._subparsers._group_actions[0].choices["generate"]
    choices = next(a.choices for a in gen._actions if a.dest == "method")
    assert list(choices) == methods.names()
    assert EngineConfig().method == methods.DEFAULT_METHOD == "ragged"
    assert not methods.get(methods.DEFAULT_METHOD).broken


def test_method_flags_drive_the_config():
    assert EngineConfig(method="ar").speculative is False
    assert EngineConfig(method="ragged").speculative is True
    with pytest.raises(BatchspecError, match="unknown method 'fast'; choose one of reference, ar"):
        EngineConfig(method="fast")
    assert {m.name for m in methods.METHODS.values() if m.admits_rows} == {"ar", "exspec", "ragged"}
    assert {m.name for m in methods.METHODS.values() if m.broken} == {"bsp", "dsd"}


def test_layouts_and_proposers_meet_the_protocols(tiny32):
    cpu = torch.device("cpu")
    seqs = [Sequence(index=i, prompt_ids=[1, 2, 3][: i + 1], max_len=10, eos_ids=frozenset()) for i in range(2)]
    for cls in (PaddedBatch, BSPBatch, DSDBatch):
        assert isinstance(cls(seqs, {"target": kv.empty(tiny32.target.config)}, 0, cpu), Layout), cls.__name__
    assert isinstance(RaggedBatch({"target": tiny32.target}, capacity=2, budget=64, k=2, pad_id=0, device=cpu), Layout)
    for proposer in (DraftProposer(tiny32.draft, tiny32.vocab_size), NgramProposer(tiny32.vocab_size)):
        assert isinstance(proposer, Proposer)


def test_bench_plot_without_matplotlib_fails_before_any_work(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    monkeypatch.setattr(cli, "load_models", lambda args: pytest.fail("models were loaded before the check"))
    assert cli.main(["bench", "--pair", "tiny", "--plot", "out.png", "hello"]) == 2
    assert "--plot needs matplotlib: pip install 'batchspec[plot]'" in capsys.readouterr().err
