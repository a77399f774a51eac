"""Bounded rendering of untrusted Jinja templates: time and memory limits enforced while the template runs.

jinja2's ``ImmutableSandboxedEnvironment`` keeps a template away from the interpreter, but not from the machine: a
chat template from a model folder could loop for hours (nested ``range(100000)``), or build gigabytes in one
expression (``'x' * 10**10``, ``tojson(indent=10**9)``, ``messages * 10**9``). ``BoundedEnvironment`` checks, before
each operation runs, what it would take, through the sandbox's own hooks (``call``, ``call_binop``, ``getattr``,
``getitem``), its filters, its string joins (``~``, ``{% set %}`` blocks, macro bodies) and every ``for`` loop:

- time: every loop step, call, operator, filter and attribute lookup checks a deadline (``Bounds.seconds``);
- size: no value the template makes — and not the output — may hold more than ``Bounds.chars`` characters or items
  (widths, counts and repeat factors are checked before the work: ``'x' * 10**10`` allocates nothing), and integers
  are kept under ``Bounds.int_bits`` bits;
- memory: every value made is charged to a budget of ``Bounds.spend`` bytes, so a loop that keeps making values
  ends too.

A limit reached raises ``TemplateLimitError`` (a jinja2 ``SecurityError``), naming the operation and the limit.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import jinja2
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .template_budget import Bounds, TemplateLimitError, active, bounded_str, current, join_bounded, rendering
from .template_checks import bounded_filter, bounded_lipsum, bounded_range, bounded_tojson, check_binop, check_method


class _Ticking:
    """A ``for`` loop's iterable, checking the deadline at every step (``len`` passed through for ``loop.length``)."""

    def __init__(self, iterable: Any) -> None:
        budget = active()
        if budget is None:  # compile-time folding: done at render time instead
            raise TemplateLimitError("a for loop runs while rendering only")
        self.source, self.iterator, self.budget = iterable, iter(iterable), budget

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.budget.tick("a for loop")
        return next(self.iterator)

    def __len__(self) -> int:
        return len(self.source)


class _BoundedCodeGenerator(CodeGenerator):
    """jinja2's code generator, with every ``for`` loop's iterable ticking and every ``~`` joining bounded."""

    def visit_Template(self, node: jinja2.nodes.Template, frame: Any = None) -> None:
        for loop in node.find_all(jinja2.nodes.For):
            loop.iter = jinja2.nodes.Filter(loop.iter, "zoo.ticking", [], [], None, None)
        super().visit_Template(node, frame)

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.join_text((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` whose templates run under the ``Budget`` of ``render_bounded``.

    The methods below are jinja2's hooks; each checks the deadline and the size of what it makes.

    Args:
        **options: jinja2's environment options (``trim_blocks``, ``extensions`` ...).
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset(("+", "-", "*", "/", "//", "%", "**"))

    def __init__(self, **options: Any) -> None:
        super().__init__(finalize=bounded_str, **options)
        self.filters = {name: bounded_filter(name, func) for name, func in self.filters.items()}
        self.filters["zoo.ticking"] = _Ticking
        self.filters["tojson"] = bounded_filter("tojson", bounded_tojson)
        self.globals.update(range=bounded_range, lipsum=bounded_lipsum)

    def add_filter(self, name: str, func: Callable[..., Any]) -> None:
        """Register ``func`` as the filter ``name``, bounded like the built-in ones.

        Args:
            name: the filter's name in templates.
            func: the filter.
        """
        self.filters[name] = bounded_filter(name, func)

    @staticmethod
    def concat(parts: Any) -> str:  # the text of {% set %} blocks, macro bodies and {% filter %} blocks
        """The text of a block, joined within the budget.

        Args:
            parts: the block's pieces.

        Returns:
            The text.
        """
        return join_bounded(parts, "a block's text")

    @staticmethod
    def join_text(parts: Any) -> str:
        """The operator ``~``, within the budget.

        Args:
            parts: its operands.

        Returns:
            The joined text.
        """
        return current().charge(join_bounded(parts, "the operator '~'"), "the operator '~'")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """An arithmetic operator, checked before (``check_binop``) and charged after.

        Args:
            context: the template's context.
            operator: the operator.
            left: its left operand.
            right: its right operand.

        Returns:
            The result.
        """
        budget = current()
        budget.tick(f"the operator {operator!r}")
        check_binop(operator, left, right, budget)
        return budget.charge(self.binop_table[operator](left, right), f"the operator {operator!r}")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja2's names
        """A call from a template; ``str`` methods that can grow their input are checked first (``check_method``).

        Args:
            __context: the template's context.
            __obj: what is called.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            The result, charged to the budget.
        """
        budget = current()
        name = getattr(__obj, "__name__", type(__obj).__name__)
        budget.tick(f"a call of {name}")
        method = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        if isinstance(method, types.BuiltinMethodType) and not isinstance(method.__self__, types.ModuleType):
            if method.__name__ == "join" and args and not hasattr(args[0], "__len__"):
                args = (list(args[0]), *args[1:])  # a generator: measured before it is joined
            check_method(method, args, kwargs, budget)
        return budget.charge(super().call(__context, __obj, *args, **kwargs), f"a call of {name}")

    def getattr(self, obj: Any, attribute: str) -> Any:
        """``obj.attribute`` (the sandbox's), after checking the deadline.

        Args:
            obj: the object.
            attribute: the attribute's name.

        Returns:
            The attribute.
        """
        current().tick(f"the attribute {attribute!r}")
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        """``obj[argument]`` (the sandbox's), after checking the deadline; a slice is charged to the budget.

        Args:
            obj: the object.
            argument: the key, index or slice.

        Returns:
            The item.
        """
        budget = current()
        budget.tick("a subscript")
        value = super().getitem(obj, argument)
        return budget.charge(value, "a slice") if isinstance(argument, slice) else value


def render_bounded(template: jinja2.Template, bounds: Bounds, context: dict[str, Any]) -> str:
    """Render ``template`` (of a ``BoundedEnvironment``) with ``context`` within ``bounds``.

    Args:
        template: the compiled template.
        bounds: the limits.
        context: the names the template sees.

    Returns:
        The rendered text.

    Raises:
        TemplateLimitError: a limit was reached; any other exception the template raised, as it raised it.
    """
    with rendering(bounds) as budget:
        parts, total = [], 0
        for part in template.generate(**context):
            total += len(part)
            budget.size(total, "the rendered text")
            budget.tick("the output")
            parts.append(part)
        return "".join(parts)
