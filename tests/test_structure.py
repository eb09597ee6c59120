"""The package's seams: no import cycles, one method table that everything reads, layouts and
proposers that meet the protocols the step relies on, and optional dependencies checked up front."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from batchspec import BatchspecError, EngineConfig, cli, kv, methods
from batchspec.baselines import BSPBatch, DSDBatch
from batchspec.batch import PaddedBatch
from batchspec.proposer import DraftProposer, NgramProposer, Proposer
from batchspec.ragged import RaggedBatch
from batchspec.sequence import Sequence
from batchspec.step import Layout

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "batchspec"


def _module_level_imports(path: pathlib.Path) -> set[str]:
    """Package modules imported when `path` is imported: top-level `from . import x` and
    `from .x import y`, not those inside functions or `if TYPE_CHECKING:`."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found & {p.stem for p in PACKAGE.glob("*.py")}


def test_no_import_cycles():
    graph = {p.stem: _module_level_imports(p) for p in PACKAGE.glob("*.py")}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == "done":
            return
        assert state.get(module) != "open", "import cycle: " + " -> ".join(path + [module])
        state[module] = "open"
        for dep in sorted(graph[module]):
            visit(dep, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        visit(module, [])
    assert graph["methods"] <= {"errors"}  # the table imports no runner: everyone may import it


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
    assert {m.name for m in methods.METHODS.values() if m.admits_rows} == {"exspec", "ragged"}
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
