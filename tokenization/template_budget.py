"""The budget of one bounded template rendering (``tokenization.template_bounds``): its limits (``Bounds``), what
it has left (``Budget``: a deadline and the bytes it may still make), and the size of a value's text (``deep_size``),
so that a check can refuse an operation before it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jinja2
from jinja2.utils import Namespace

#: Items of the largest list (or range) a template may make, by default (jinja2's own sandbox range limit).
MAX_RANGE = 100_000
#: Largest width, count, indent or precision a filter, method or format spec may be given.
MAX_WIDTH = 1 << 16


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A template went past a limit of ``Bounds`` (time, size, memory) while rendering."""


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Limits of one rendering.

    Args:
        seconds: wall-clock time the rendering may take.
        chars: characters of the largest value the template may make, the output included.
        items: items of the largest list, tuple or dict the template may make, and of any value a filter that works
            item by item in Python (``sort``, ``map``, ``unique`` …) is given.
        spend: bytes of all the values the template makes, together.
        int_bits: bits of the largest integer the template may compute.
    """

    seconds: float = 1.0
    chars: int = 1 << 20
    items: int = MAX_RANGE
    spend: int = 32 << 20
    int_bits: int = 1 << 14

    def widened(self, input_chars: int) -> Bounds:
        """These bounds, grown with the size of the data rendered (a long conversation is a long prompt).

        Args:
            input_chars: characters of the messages, tools and documents rendered.

        Returns:
            The wider bounds.
        """
        return dataclasses.replace(self, chars=self.chars + 2 * input_chars, items=self.items + input_chars,
                                   spend=self.spend + 8 * input_chars)


class Budget:
    """What one rendering has left: its deadline and the bytes it may still make.

    Args:
        bounds: the rendering's limits.
    """

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.deadline = time.monotonic() + bounds.seconds
        self.left = bounds.spend

    def tick(self, what: str) -> None:
        """Check the deadline.

        Args:
            what: what is being made, for the message.

        Raises:
            TemplateLimitError: the time limit has passed.
        """
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the template ran past its time limit of {self.bounds.seconds} s (at {what})")

    def size(self, n: int, what: str) -> None:
        """Check a value's length against ``chars``.

        Args:
            n: characters (or items) of the value.
            what: what is being made, for the message.

        Raises:
            TemplateLimitError: ``n`` is above ``chars``.
        """
        if n > self.bounds.chars:
            raise TemplateLimitError(f"{what} would make a value of {n} characters or items; a template may make at "
                                     f"most {self.bounds.chars}")

    def count(self, n: int, what: str) -> None:
        """Check an item count against ``items``.

        Args:
            n: items made or gone through.
            what: what is being made, for the message.

        Raises:
            TemplateLimitError: ``n`` is above ``items``.
        """
        if n > self.bounds.items:
            raise TemplateLimitError(f"{what} would make or go through {n} items; a template may use at most "
                                     f"{self.bounds.items}")

    def charge(self, value: Any, what: str) -> Any:
        """Check a value the template made (length, item count, integer size) and spend its bytes.

        Args:
            value: the value.
            what: what is being made, for the message.

        Returns:
            ``value``.

        Raises:
            TemplateLimitError: a value past a limit, or more bytes made in all than ``spend``.
        """
        if isinstance(value, (str, bytes)):
            self.size(len(value), what)
        elif isinstance(value, (list, tuple, dict)):
            self.count(len(value), what)
        elif isinstance(value, int) and value.bit_length() > self.bounds.int_bits:
            raise TemplateLimitError(f"{what} made an integer of {value.bit_length()} bits; at most "
                                     f"{self.bounds.int_bits}")
        self.left -= sys.getsizeof(value, 64)
        if self.left < 0:
            raise TemplateLimitError(f"the template made more than {self.bounds.spend} bytes of values (at {what})")
        return value


ACTIVE: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("template_budget", default=None)


def current() -> Budget:
    """The budget of the rendering in progress (one of ``Bounds()`` outside a rendering: compile-time folding).

    Returns:
        The budget.
    """
    budget = ACTIVE.get()
    return budget if budget is not None else Budget(Bounds())


def charge(value: Any, what: str) -> Any:
    """Charge ``value`` to the rendering in progress (a no-op outside one); return it.

    Args:
        value: the value the template made.
        what: what it is, for the message.

    Returns:
        ``value``.
    """
    budget = ACTIVE.get()
    return value if budget is None else budget.charge(value, what)


def deep_size(value: Any, limit: int) -> tuple[int, int]:
    """About how many characters ``str(value)`` has, and how deep ``value`` nests; counting stops past ``limit``.

    Strings count their length, containers two per item, numbers their digits. Iterative (no recursion) and
    bounded: at most ``limit`` steps, whatever ``value`` is (even a namespace that holds itself).

    Args:
        value: any value a template holds.
        limit: stop counting past this many characters.

    Returns:
        ``(characters, depth)``.
    """
    total, deepest, stack = 0, 0, [(value, 1)]
    while stack and total <= limit:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, Namespace):
            attrs = object.__getattribute__(item, "__dict__").get("_Namespace__attrs", {})
            total += 12
            stack.append((attrs, depth + 1))
        elif isinstance(item, Mapping):
            total += 2 + 4 * len(item)
            if total <= limit:
                stack.extend((part, depth + 1) for pair in item.items() for part in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)
            if total <= limit:
                stack.extend((part, depth + 1) for part in item)
        else:
            total += 24
    return total, deepest


def bounded_str(value: Any) -> str:
    """``str(value)``, refused when it would be longer than the rendering's ``chars`` (a list of a million references
    to one long string is small, its text is not).

    Args:
        value: any value.

    Returns:
        Its text.
    """
    if isinstance(value, str):
        return value
    budget = current()
    budget.size(deep_size(value, budget.bounds.chars)[0], f"the text of a {type(value).__name__}")
    return budget.charge(str(value), f"the text of a {type(value).__name__}")


def join_bounded(parts: Any, what: str) -> str:
    """The texts of ``parts`` joined, refused as soon as the result would be longer than the rendering's ``chars``.

    Args:
        parts: the values to join.
        what: what is being made, for the message.

    Returns:
        The joined text.
    """
    budget = current()
    texts, total = [], 0
    for part in parts:
        text = bounded_str(part)
        total += len(text)
        budget.size(total, what)
        texts.append(text)
    return "".join(texts)



def active() -> Budget | None:
    """The budget of the rendering in progress in this thread (or task), None outside one.

    Returns:
        The budget, or None.
    """
    return ACTIVE.get()


@contextlib.contextmanager
def rendering(bounds: Bounds) -> Iterator[Budget]:
    """Make a fresh ``Budget`` of ``bounds`` the active one while the block runs.

    Args:
        bounds: the rendering's limits.

    Yields:
        The budget.
    """
    budget = Budget(bounds)
    token = ACTIVE.set(budget)
    try:
        yield budget
    finally:
        ACTIVE.reset(token)
