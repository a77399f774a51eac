"""Every public function, method and class documents what it takes, returns and raises, and the shapes of its tensors.

The rule (docs/contributing.md, "Docstrings"), read from the source with ``ast`` (nothing is imported):

- public: no part of the module's path and not the name itself starts with an underscore; methods of public classes
  count, ``__init__`` through its class; properties, ``@overload`` stubs and other dunder methods do not, and neither
  does a method without a docstring of its own that overrides a documented method of a base class in these packages,
  one of torch's hooks (``TORCH_HOOKS``), or a ``forward`` whose class docstring has the ``Shapes:`` line;
- a docstring at all;
- ``Args:`` when it takes parameters besides ``self``/``cls`` (the strict docs build checks that the names it
  documents exist); a dataclass documents its fields under ``Attributes:`` or ``Args:``; a class's parameters are its
  ``__init__``'s, documented on the class or on ``__init__``;
- ``Returns:`` (or ``Yields:``) when the return annotation is not ``None``, or the body returns a value;
- ``Raises:`` when the body itself raises (a bare re-``raise`` does not count);
- a ``Shapes:`` line when an annotation of a parameter or of the return mentions ``Tensor`` (for ``forward`` and
  ``__call__``, the class's docstring may hold it).

Names that do not meet the rule yet are listed in ``tests/docstring_todo.txt``: the list may only shrink.
"""

from __future__ import annotations

import ast
import functools
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("blocks", "models", "tokenization", "training", "serving", "cli")
TODO = ROOT / "tests" / "docstring_todo.txt"
SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Attributes|Returns|Yields|Raises|Shapes?)\s*:", re.M)
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
#: Methods a class overrides to customise torch's own behaviour (``nn.Module``'s, ``autograd.Function``'s); torch
#: documents them.
TORCH_HOOKS = frozenset({"extra_repr", "reset_parameters", "backward", "setup_context", "get_lr"})


@dataclass(frozen=True)
class Public:
    name: str  # dotted: package.module.Class.method
    node: ast.AST
    owner: ast.ClassDef | None


@functools.cache
def modules() -> tuple[tuple[str, ast.Module], ...]:
    """Every public module of the packages, parsed once: ``(dotted name, tree)``."""
    return tuple(_modules())


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if any(p.startswith("_") and p != "__init__" for p in parts):
                continue
            dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield dotted, ast.parse(path.read_text(), str(path))


def decorators(node: FunctionNode | ast.ClassDef) -> set[str]:
    names = set()
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


def base_names(cls: ast.ClassDef) -> list[str]:
    return [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.bases]


def all_classes() -> dict[str, list[ast.ClassDef]]:
    """Every class of the packages by its bare name (bases are looked up by name: close enough for docs)."""
    index: dict[str, list[ast.ClassDef]] = {}
    for _, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append(node)
    return index


def documented_in_a_base(cls: ast.ClassDef, method: str, index: dict[str, list[ast.ClassDef]]) -> bool:
    seen: set[str] = set()
    todo = base_names(cls)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for base in index.get(name, []):
            for item in base.body:
                if isinstance(item, FunctionNode) and item.name == method and ast.get_docstring(item):
                    return True
            todo.extend(base_names(base))
    return False


def shapes_on_class(cls: ast.ClassDef) -> bool:
    """A module whose class docstring has the ``Shapes:`` line documents its ``forward`` there."""
    return "Shapes" in sections(ast.get_docstring(cls) or "")


def public_names() -> Iterator[Public]:
    index = all_classes()
    for module, tree in modules():
        for node in tree.body:
            if isinstance(node, FunctionNode | ast.ClassDef) and not node.name.startswith("_"):
                yield Public(f"{module}.{node.name}", node, None)
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for item in node.body:
                    if not isinstance(item, FunctionNode) or item.name.startswith("_"):
                        continue
                    if decorators(item) & {"property", "cached_property", "overload", "setter", "deleter"}:
                        continue
                    if not ast.get_docstring(item) and (documented_in_a_base(node, item.name, index)
                                                        or item.name in TORCH_HOOKS
                                                        or item.name == "forward" and shapes_on_class(node)):
                        continue
                    yield Public(f"{module}.{node.name}.{item.name}", item, node)


def parameters(fn: FunctionNode, *, method: bool) -> list[str]:
    a = fn.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    if method and names and names[0] in ("self", "cls") and "staticmethod" not in decorators(fn):
        names = names[1:]
    names += [f"*{a.vararg.arg}"] if a.vararg else []
    names += [f"**{a.kwarg.arg}"] if a.kwarg else []
    return names


def own_statements(fn: FunctionNode) -> Iterator[ast.AST]:
    """The nodes of ``fn``'s body, not those of functions or classes defined inside it."""
    todo: list[ast.AST] = list(fn.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, FunctionNode | ast.ClassDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def sections(doc: str) -> set[str]:
    found = {m.group(1) for m in SECTION.finditer(doc)}
    return {"Args" if s in ("Arguments", "Parameters") else "Shapes" if s == "Shape" else s for s in found}


def mentions_tensor(fn: FunctionNode) -> bool:
    """A parameter or the return is annotated with ``Tensor`` (a callable's signature, ``Callable[[...], Tensor]``,
    is another function's business)."""
    annotations = [p.annotation for p in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    annotations += [fn.returns]
    return any(a is not None and tensor_outside_callables(a) for a in annotations)


def tensor_outside_callables(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return tensor_outside_callables(ast.parse(node.value, mode="eval").body)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value).split(".")[-1] == "Callable":
        return False
    if isinstance(node, ast.Name | ast.Attribute) and ast.unparse(node).split(".")[-1] == "Tensor":
        return True
    return any(tensor_outside_callables(child) for child in ast.iter_child_nodes(node))


def returns_something(fn: FunctionNode) -> bool:
    if fn.returns is not None:
        text = ast.unparse(fn.returns).strip("'\"")
        return text not in ("None", "NoReturn", "Never")
    return any(isinstance(n, ast.Return) and n.value is not None for n in own_statements(fn))


def raises(fn: FunctionNode) -> bool:
    return any(isinstance(n, ast.Raise) and n.exc is not None for n in own_statements(fn))


def is_generator(fn: FunctionNode) -> bool:
    return any(isinstance(n, ast.Yield | ast.YieldFrom) for n in own_statements(fn))


def missing(item: Public) -> list[str]:
    """What ``item``'s docstring lacks under the rule, as section names; empty when it meets it."""
    node = item.node
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, FunctionNode) and n.name == "__init__"), None)
        doc = (ast.get_docstring(node) or "") + "\n" + ((init and ast.get_docstring(init)) or "")
        if not doc.strip():
            return ["docstring"]
        lacks = []
        if init is not None:
            params = parameters(init, method=True)
            if params and "Args" not in sections(doc):
                lacks.append("Args")
            if raises(init) and "Raises" not in sections(doc):
                lacks.append("Raises")
            if mentions_tensor(init) and "Shapes" not in sections(doc):
                lacks.append("Shapes")
        elif "dataclass" in decorators(node):
            fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                      and "ClassVar" not in ast.unparse(n.annotation)]
            if fields and not {"Attributes", "Args"} & sections(doc):
                lacks.append("Attributes")
        return lacks
    doc = ast.get_docstring(node) or ""
    if not doc.strip():
        return ["docstring"]
    found = sections(doc)
    lacks = []
    params = parameters(node, method=item.owner is not None)
    if params and "Args" not in found:
        lacks.append("Args")
    if returns_something(node) and not {"Returns", "Yields"} & found:
        lacks.append("Yields" if is_generator(node) else "Returns")
    if raises(node) and "Raises" not in found:
        lacks.append("Raises")
    if mentions_tensor(node) and "Shapes" not in found:
        class_doc = ast.get_docstring(item.owner) or "" if item.owner is not None else ""
        if not (node.name in ("forward", "__call__") and "Shapes" in sections(class_doc)):
            lacks.append("Shapes")
    return lacks


def violations() -> dict[str, list[str]]:
    return {item.name: lacks for item in public_names() if (lacks := missing(item))}


def todo_list() -> set[str]:
    if not TODO.exists():
        return set()
    return {line.split("#")[0].strip() for line in TODO.read_text().splitlines() if line.split("#")[0].strip()}


def parse(source: str) -> ast.AST:
    return ast.parse(textwrap.dedent(source)).body[0]


def test_the_rule_finds_what_it_should() -> None:
    source = '''
        def scale(x: Tensor, factor: float) -> Tensor:
            """Scale.

            Args:
                x: values.
                factor: the factor.

            Returns:
                x times factor.
            """
            if factor < 0:
                raise ValueError(factor)
            return x * factor
        '''
    assert missing(Public("m.scale", parse(source), None)) == ["Raises", "Shapes"]
    assert missing(Public("m.scale", parse(source.replace("Args:", "Notes:")), None)) == ["Args", "Raises", "Shapes"]
    fixed = source.replace("    Returns:", "    Shapes: ``(...)`` -> same.\n\n            Raises:\n"
                                            "                ValueError: below 0.\n\n            Returns:")
    assert missing(Public("m.scale", parse(fixed), None)) == []
    generator = '''
        def steps(n: int) -> Iterator[int]:
            """Count.

            Args:
                n: how many.
            """
            yield n
        '''
    assert missing(Public("m.steps", parse(generator), None)) == ["Yields"]
    cls = '''
        class Box:
            """A box."""

            def __init__(self, size: int) -> None:
                self.size = size
        '''
    assert missing(Public("m.Box", parse(cls), None)) == ["Args"]
    args = "\n\n            Args:\n                size: its side.\n            "
    documented = cls.replace('"""A box."""', f'"""A box.{args}"""')
    assert missing(Public("m.Box", parse(documented), None)) == []


def test_public_names_document_args_returns_raises_and_shapes() -> None:
    found = violations()
    todo = todo_list()
    new = {name: lacks for name, lacks in found.items() if name not in todo}
    fixed = sorted(todo - set(found))
    assert not new, "document these (docs/contributing.md, 'Docstrings'):\n" + "\n".join(
        f"{name}: {', '.join(lacks)}" for name, lacks in sorted(new.items()))
    assert not fixed, f"these meet the rule now: remove them from {TODO.name}: {fixed}"
