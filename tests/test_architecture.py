"""The house rules, checked: one-way layers (the ``.importlinter`` contracts), no import cycles between modules, no
private name imported across modules, small modules, and every import the README and the docs pages document.

The import graph comes from ``grimp`` (import-linter's graph builder), which reads every import statement of a
module, including those inside functions.
"""

from __future__ import annotations

import ast
import copy
import importlib
import re
from pathlib import Path

import grimp
import pytest
from importlinter import api as importlinter_api
from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.independence import IndependenceContract
from importlinter.contracts.layers import LayersContract

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("blocks", "tokenization", "models", "training", "serving", "cli", "benchmarks")
CONTRACT_TYPES = {
    cls.type_name: cls for cls in (LayersContract, ForbiddenContract, IndependenceContract, AcyclicSiblingsContract)
}
#: The issue that set the layout asked for about 450 lines at most; a module past this is split along its seams.
MAX_MODULE_LINES = 450


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


@pytest.fixture(scope="module")
def options():
    return importlinter_api.read_configuration(str(ROOT / ".importlinter"))


def broken_contracts(graph: grimp.ImportGraph, options) -> list[str]:
    broken = []
    for contract_options in options["contracts_options"]:
        cls = CONTRACT_TYPES[contract_options["type"]]
        contract = cls(
            name=contract_options["name"], session_options=options["session_options"],
            contract_options=contract_options,
        )
        if not contract.check(copy.deepcopy(graph), verbose=False).kept:
            broken.append(contract_options["name"])
    return broken


def test_every_layer_contract_holds(graph, options) -> None:
    assert len(options["contracts_options"]) >= 5
    assert broken_contracts(graph, options) == []


@pytest.mark.parametrize(
    ("importer", "imported", "contract"),
    [
        ("models.core.base", "models.decoder_lm", "models:"),  # core reaching up to a model class
        ("models.convert.registry", "models.convert.llama", "models.convert:"),  # the registry importing a family
        ("blocks.attention", "models.core.config", "Top-level"),  # blocks importing models
        ("models.generation.steps", "models.generation.decoder", "No import cycles"),  # a cycle inside generation
        ("models.generation.sampling", "models.convert.export", "Generation and the converter"),
    ],
)
def test_a_back_edge_breaks_a_contract(graph, options, importer: str, imported: str, contract: str) -> None:
    changed = copy.deepcopy(graph)
    changed.add_import(importer=importer, imported=imported, line_number=1, line_contents=f"import {imported}")
    assert any(name.startswith(contract) for name in broken_contracts(changed, options))


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's algorithm over the module graph: the groups of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in sorted(graph.find_modules_directly_imported_by(module)):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                group.append(other)
                if other == module:
                    break
            groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def test_no_import_cycles_between_modules(graph) -> None:
    assert [group for group in strongly_connected(graph) if len(group) > 1] == []


def test_the_cycle_finder_finds_a_cycle(graph) -> None:
    changed = copy.deepcopy(graph)
    changed.add_import(importer="models.core.base", imported="models.decoder_lm", line_number=1, line_contents="x")
    cycles = [group for group in strongly_connected(changed) if len(group) > 1]
    assert any({"models.core.base", "models.decoder_lm"} <= set(group) for group in cycles)


def project_files() -> list[Path]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    return sorted(files + list((ROOT / "examples").glob("*.py")))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from X import _y`` (or ``import X._y``) naming a project module other than the file's own."""
    name = module_name(path, root)
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] not in PACKAGES or target == name:
                continue
            found += [f"{name}: from {target} import {a.name}" for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in target.split(".")):
                found.append(f"{name}: {target}")
        elif isinstance(node, ast.Import):
            found += [
                f"{name}: import {a.name}" for a in node.names
                if a.name.split(".")[0] in PACKAGES and any(p.startswith("_") for p in a.name.split("."))
            ]
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    assert [line for path in project_files() for line in private_imports(path)] == []


def test_the_private_import_check_sees_them(tmp_path: Path) -> None:
    (tmp_path / "models" / "sub").mkdir(parents=True)
    source = tmp_path / "models" / "sub" / "thing.py"
    source.write_text(
        "from .other import _helper, fine\nfrom models import public\nfrom ._hidden import x\n"
        "def f():\n    from ..core import _late\n"
    )
    assert sorted(private_imports(source, tmp_path)) == [
        "models.sub.thing: from models.core import _late",
        "models.sub.thing: from models.sub.other import _helper",
        "models.sub.thing: models.sub._hidden",
    ]


@pytest.mark.parametrize("package", ["blocks", "models", "training", "serving"])
def test_modules_stay_small(package: str) -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"split these along their seams (limit {MAX_MODULE_LINES} lines)"


# ------------------------------------------------------------------------------------ the README's and docs' names
#: The README and every page of the docs site, read as one text.
README = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
DOTTED = re.compile(r"`((?:models|blocks|training|serving|tokenization|cli)(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT = re.compile(r"^\s*from ((?:models|blocks|training|serving|tokenization|cli)[\w.]*) import ([\w, ]+)", re.M)


def documented_names() -> list[str]:
    """Every ``pkg.module.name`` in backticks and every ``from pkg import a, b`` line of the README and docs/."""
    names = {m.group(1) for m in DOTTED.finditer(README) if not m.group(1).endswith(".py")}  # `cli.py` is a file
    for m in FROM_IMPORT.finditer(README):
        names.update(f"{m.group(1)}.{n.strip()}" for n in m.group(2).split(",") if n.strip())
    return sorted(names)


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted`` and look the rest up as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_readme_documents_names_at_all() -> None:
    names = documented_names()
    for expected in ("models.auto.LoadOptions", "models.convert.save_transformers", "models.gguf.read_gguf",
                     "models.Seq2SeqTransformer", "models.EncoderLM", "models.DecoderLM", "models.from_pretrained"):
        assert expected in names


@pytest.mark.parametrize("dotted", documented_names())
def test_every_name_the_readme_documents_imports(dotted: str) -> None:
    assert resolve(dotted) is not None
