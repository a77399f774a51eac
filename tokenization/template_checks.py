"""The checks a bounded template rendering makes before an operation runs (``tokenization.template_bounds``): what a
format, a filter, a ``str`` method or an operator would make, from its arguments — ``'x' * 10**10`` is refused
before anything is allocated — and the bounded versions of jinja2's ``range``, ``lipsum`` and of ``tojson``.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from jinja2.utils import generate_lorem_ipsum

from .template_budget import MAX_WIDTH, Budget, TemplateLimitError, active, bounded_str, current, deep_size


def check_format(fmt: str, args: Any, what: str) -> None:
    """Refuse a ``str.format`` or ``%`` format whose widths or precisions (in the spec, or taken from the arguments
    by ``*`` or a nested field) are over ``MAX_WIDTH``, or whose arguments' text is over the limit.

    Args:
        fmt: the format string.
        args: its arguments.
        what: the call, for the message.

    Raises:
        TemplateLimitError: a bad format string, or a width, precision or argument text past the limit.
    """
    budget = current()
    if "%" in what:
        specs = re.findall(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?", fmt)
        numbers = [n for spec in specs for n in spec if n and n != "*"]
        starred = any("*" in spec for spec in specs)
    else:
        try:
            fields = list(string.Formatter().parse(fmt))
        except ValueError as err:
            raise TemplateLimitError(f"{what}: bad format string: {err}") from None
        specs = [spec or "" for _, _, spec, _ in fields]
        numbers = [n for spec in specs for n in re.findall(r"\d+", spec)]
        starred = any("{" in spec for spec in specs)
    for number in numbers:
        if len(number) > 6 or int(number) > MAX_WIDTH:
            raise TemplateLimitError(f"{what}: a width or precision of {number} in {fmt[:60]!r}; at most {MAX_WIDTH}")
    values = args if isinstance(args, (tuple, list)) else list(args.values()) if isinstance(args, Mapping) else [args]
    if starred:
        _check_counts(values, what)
    budget.size(deep_size(values, budget.bounds.chars)[0] + len(fmt), what)


def _check_counts(values: Any, what: str) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
            raise TemplateLimitError(f"{what} was given {value}; a width or count may be at most {MAX_WIDTH}")


def _text_len(value: Any, budget: Budget, what: str) -> int:
    """The length of the text a filter makes of ``value`` (checked against the limit)."""
    if isinstance(value, str):
        return len(value)
    n = deep_size(value, budget.bounds.chars)[0]
    budget.size(n, what)
    return n


def _check_filter(name: str, args: tuple, kwargs: dict, budget: Budget) -> None:
    """Pre-checks of the filters that can make more than they are given."""
    what = f"the filter {name}"
    values = list(args) + list(kwargs.values())
    value = args[0] if args else kwargs.get("s", kwargs.get("value"))
    if name in ("center", "indent", "wordwrap", "truncate", "batch", "slice", "round", "filesizeformat"):
        _check_counts(values[1:], what)
    if name in _ITEM_BY_ITEM and hasattr(value, "__len__"):
        budget.count(len(value), what)
    if name in ("string", "pprint", "e", "escape", "forceescape", "safe", "urlize", "striptags", "upper", "lower",
                "title", "capitalize", "trim", "list", "xmlattr", "urlencode", "wordcount"):
        _text_len(value, budget, what)
    elif name == "center":
        budget.size(max(_text_len(value, budget, what), int(values[1]) if len(values) > 1 else 80), what)
    elif name == "indent":
        width = kwargs.get("width", args[1] if len(args) > 1 else 4)
        n = len(width) if isinstance(width, str) else int(width)
        budget.size(_text_len(value, budget, what) + n * (str(value).count("\n") + 1), what)
    elif name == "wordwrap":
        text = _text_len(value, budget, what)
        wrap = kwargs.get("wrapstring", args[3] if len(args) > 3 else None) or "\n"
        width = kwargs.get("width", args[1] if len(args) > 1 else 79)
        budget.size(text * (1 + len(str(wrap))) // max(1, int(width)) + text, what)
    elif name == "replace":
        old = str(kwargs.get("old", args[1] if len(args) > 1 else ""))
        new = str(kwargs.get("new", args[2] if len(args) > 2 else ""))
        text = str(value) if isinstance(value, str) else bounded_str(value)
        budget.size(len(text) + (text.count(old) if old else len(text) + 1) * len(new), what)
    elif name == "join":
        sep = str(kwargs.get("d", args[1] if len(args) > 1 else ""))
        budget.size(deep_size(value, budget.bounds.chars)[0] + len(sep) * len(value), what)
    elif name == "format":
        check_format(str(value), values[1:], "the filter format (%)")
    elif name == "sum":
        start = kwargs.get("start", args[2] if len(args) > 2 else 0)
        if not isinstance(start, (int, float)):
            raise TemplateLimitError(f"{what}: start={type(start).__name__}; only numbers may be summed")


_ITEM_BY_ITEM = frozenset(("sort", "unique", "dictsort", "groupby", "map", "select", "reject", "selectattr",
                           "rejectattr", "sum", "min", "max", "list", "batch", "slice", "random", "items", "tojson",
                           "xmlattr", "urlencode", "first", "last"))


def bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, the filter ``name``, with the deadline, its pre-checks and the size of its result checked.

    Args:
        name: the filter's name in templates.
        func: jinja2's filter.

    Returns:
        The bounded filter.
    """
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0

    def run(*args: Any, **kwargs: Any) -> Any:
        budget = active()
        if budget is None:  # compile-time folding of constants: done at render time instead, under a budget
            raise TemplateLimitError(f"the filter {name} runs while rendering only")
        budget.tick(f"the filter {name}")
        if name == "join" and len(args) > skip and not hasattr(args[skip], "__len__"):
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])  # a generator: measured before it is joined
        _check_filter(name, args[skip:], kwargs, budget)
        return budget.charge(func(*args, **kwargs), f"the filter {name}")

    for attr in ("jinja_pass_arg", "jinja_async_variant"):
        if hasattr(func, attr):
            setattr(run, attr, getattr(func, attr))
    run.__name__ = getattr(func, "__name__", name)
    return run


def bounded_tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
    """``tojson`` (json.dumps without ASCII or HTML escaping, as ``transformers``') with the indent and separators
    bounded (at most 16 characters) and the result's size checked before it is made.

    Args:
        x: the value.
        ensure_ascii: escape non-ASCII characters.
        indent: None, 0..16, or a string of at most 16 characters.
        separators: two strings of at most 16 characters, or None.
        sort_keys: sort dict keys.

    Returns:
        The JSON text.

    Raises:
        TemplateLimitError: a bad indent or separators.
    """
    budget = current()
    width = len(indent) if isinstance(indent, str) else indent
    if width is not None and (not isinstance(width, int) or not 0 <= width <= 16):
        raise TemplateLimitError(f"tojson(indent={indent!r:.40}): expected None, 0..16 or a string of at most 16")
    if separators is not None and (not isinstance(separators, (list, tuple)) or len(separators) != 2
                                   or any(not isinstance(s, str) or len(s) > 16 for s in separators)):
        raise TemplateLimitError(f"tojson(separators={separators!r:.40}): expected two strings of at most 16")
    size, depth = deep_size(x, budget.bounds.chars)
    budget.size(size * (1 + (width or 0) * depth) if width else size, "tojson")
    return budget.charge(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                    sort_keys=sort_keys), "tojson")


def bounded_range(*args: Any) -> range:
    """jinja2's ``range``, at most ``Bounds.items`` items.

    Args:
        *args: as ``range``.

    Returns:
        The range.
    """
    rng = range(*args)
    current().count(len(rng), f"range{args}")
    return rng


def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja2's ``lipsum``, at most 100 paragraphs of at most 1000 words.

    Args:
        n: paragraphs.
        html: wrap them in ``<p>``.
        min: fewest words per paragraph.
        max: most words per paragraph.

    Returns:
        The text.

    Raises:
        TemplateLimitError: ``n`` above 100, or ``min``/``max`` above 1000.
    """
    for name, value, top in (("n", n, 100), ("min", min, 1000), ("max", max, 1000)):
        if not isinstance(value, int) or value > top:
            raise TemplateLimitError(f"lipsum({name}={value!r:.40}): at most {top}")
    return generate_lorem_ipsum(n, html, min, max)


_AMPLIFYING = ("center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "translate")


def check_method(method: Any, args: tuple, kwargs: dict, budget: Budget) -> None:
    """Pre-checks of the ``str`` (and ``bytes``) methods that can make more than they are given.

    Args:
        method: the bound method about to be called.
        args: its positional arguments.
        kwargs: its keyword arguments.
        budget: the rendering's budget.
    """
    name, owner = method.__name__, method.__self__
    what = f"{type(owner).__name__}.{name}"
    if name in ("format", "format_map") and isinstance(owner, str):
        check_format(owner, args[0] if name == "format_map" and args else (*args, *kwargs.values()), what)
        return
    if name not in _AMPLIFYING or not isinstance(owner, (str, bytes)):
        return
    values = list(args) + list(kwargs.values())
    if name == "replace":
        old, new = (values + ["", ""])[:2]
        count = owner.count(old) if old else len(owner) + 1
        budget.size(len(owner) + count * len(new), what)
    elif name == "join":
        items = values[0] if values else []
        budget.size(deep_size(items, budget.bounds.chars)[0] + len(owner) * len(items), what)
    elif name == "translate":
        table = values[0] if values else {}
        longest = max((len(v) for v in table.values() if isinstance(v, (str, bytes))), default=1) \
            if isinstance(table, Mapping) else 1
        budget.size(len(owner) * longest, what)
    elif name == "expandtabs":
        _check_counts(values, what)
        budget.size(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * int(values[0] if values
                                                                                              else 8), what)
    else:
        _check_counts(values, what)
        budget.size(max([len(owner)] + [v for v in values if isinstance(v, int)]), what)


def check_binop(operator: str, left: Any, right: Any, budget: Budget) -> None:
    """Refuse a binary operation whose result would be past the budget's limits (``*`` of a long string, ``**``
    making a huge integer ...) before it runs.

    Args:
        operator: the operator.
        left: its left operand.
        right: its right operand.
        budget: the rendering's budget.

    Raises:
        TemplateLimitError: the result would be past a limit.
    """
    what = f"the operator {operator!r}"
    sequence = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(right, sequence) and isinstance(left, int):
            left, right = right, left
        if isinstance(left, sequence) and isinstance(right, int):
            times = max(right, 0)
            (budget.size if isinstance(left, (str, bytes)) else budget.count)(len(left) * times, what)
            budget.size(deep_size(left, budget.bounds.chars)[0] * times if times else 0, what)
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > budget.bounds.int_bits:
                raise TemplateLimitError(f"{what} would make an integer of over {budget.bounds.int_bits} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > budget.bounds.int_bits:
                raise TemplateLimitError(f"{left} ** {right} would make an integer of about {left.bit_length() * right}"
                                         f" bits; at most {budget.bounds.int_bits}")
    elif operator == "+":
        if isinstance(left, sequence) and isinstance(right, sequence):
            (budget.size if isinstance(left, (str, bytes)) else budget.count)(len(left) + len(right), what)
    elif operator == "%" and isinstance(left, str):
        check_format(left, right, "the operator '%'")


