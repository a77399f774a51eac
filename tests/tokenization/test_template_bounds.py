"""Chat templates are bounded while they render: whatever a hostile template does — loop, recurse, build gigabytes in
one expression or a little at a time, include other templates, call ``tojson`` with odd arguments — the rendering
returns within 2 s and under 64 MiB of extra memory with a ``ValueError`` that names the template's line and what
it did. Real templates on a long conversation still render."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from tokenization.chat import render_chat
from tokenization.template_bounds import BoundedEnvironment, render_bounded
from tokenization.template_budget import Bounds, TemplateLimitError

from .chat_templates import QWEN3
from .test_chat import CHATML

MESSAGES = [{"role": "user", "content": "hi"}]

#: (template, what the error names): each is what the issue reported, or the same class of attack by another route.
HOSTILE = {
    "lipsum": ("{{ lipsum(n=10**6) }}", r"lipsum\(n=1000000\)"),
    "repeat string": ("{{ 'x' * 10**10 }}", r"operator '\*' would make a value of 10000000000"),
    "repeat messages": ("{{ messages * 10**9 }}", r"operator '\*' would make or go through 1000000000 items"),
    "tojson indent": ("{{ messages|tojson(indent=10**9) }}", r"tojson\(indent=1000000000\)"),
    "tojson default": ("{{ messages|tojson(default=1) }}", r"TypeError: .*unexpected keyword argument 'default'"),
    "range": ("{% for i in range(10**9) %}{% endfor %}", r"range\(1000000000,\) would make or go through"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "include": ("{% include 'other.jinja' %}", r"uses {% include %} \(line 1\)"),
    "import": ("{% import 'other.jinja' as o %}", r"uses {% import %} \(line 1\)"),
    "extends": ("{% extends 'other.jinja' %}", r"uses {% extends %} \(line 1\)"),
    "power": ("{% set x = 9 ** 999999 %}", r"9 \*\* 999999 would make an integer"),
    "doubling": ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 r"operator '~' would make a value"),
    "references as text": ("{{ (['x' * 100000] * 1000)|join }}", r"operator '\*' would make a value of 100006000"),
    "join separator": ("{% set s = 'y' * 100000 %}{{ range(1000)|join(s) }}", r"the filter join would make a value"),
    "center": ("{{ 'x'|center(10**10) }}", r"the filter center was given 10000000000"),
    "method width": ("{{ 'x'.ljust(10**10) }}", r"str.ljust was given 10000000000"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", r"str.format: a width or precision of 1000000000"),
    "percent width": ("{{ '%01000000000d' % 1 }}", r"operator '%': a width or precision of 1000000000"),
    "replace": ("{{ ('x' * 100000).replace('', 'y' * 100000) }}", r"str.replace would make a value"),
    "translate": ("{{ ('x' * 100000).translate({120: 'y' * 100000}) }}", r"str.translate would make a value"),
    "batch": ("{{ [1]|batch(10**9, 'x')|list }}", r"the filter batch was given 1000000000"),
    "sum of lists": ("{{ ([[1]] * 1000)|sum(start=[]) }}", r"only numbers may be summed"),
    "kept values": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                    "{% set ns.l = ns.l + ['x' * 100000 ~ i] %}{% endfor %}", r"made more than \d+ bytes"),
    "kept literals": ("{% set ns = namespace(x=0) %}{% for i in range(100000) %}{% set ns.x = [ns.x, "
                      + ", ".join(["i"] * 1000) + "] %}{% endfor %}", r"made more than \d+ bytes"),
    "compile": ("{{ f(a, b) }}" * 5000, r"over 12288 Jinja tokens"),
    "parse depth": ("{{ " + "(" * 400 + "1" + ")" * 400 + " }}", "does not (parse|compile)"),
    "block text": ("{% set b %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endset %}",
                   r"made more than \d+ bytes"),
    "output": ("{% for i in range(100000) %}{{ '\U0001F600' * 100000 }}{% endfor %}", r"the rendered text would"),
    # The clock is read at every loop step and every call: the limit falls on an inner step, or (rarely, on a slow
    # host) on the range() call that starts the next inner loop.
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     r"ran past its time limit of 1.0 s \(at (a for loop|a call of bounded_range)\)"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                          "{{ f(60) }}", r"ran past its time limit"),
    "int text": ("{{ messages[0].content + 5 }}", r"TypeError: can only concatenate str"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_a_value_error_within_2_s_and_64_mib(name: str) -> None:
    template, names = HOSTILE[name]
    where = r"the chat template .*(line 1|rendered text|tokens|parse|compile)"
    start = time.perf_counter()
    with pytest.raises(ValueError, match=where) as err:  # compiled and rendered: the time a first request takes
        render_chat(template, MESSAGES)
    took = time.perf_counter() - start
    assert took < 2.0, f"{name}: {took:.2f} s"
    assert err.match(names)
    tracemalloc.start()  # (slows Python down several times: the memory is measured on a second run)
    try:
        with pytest.raises(ValueError, match=where):
            render_chat(template, MESSAGES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{name}: {peak / 2**20:.1f} MiB"


def test_real_templates_render_a_long_conversation_as_before() -> None:
    long = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 20000} for i in range(40)]
    text = render_chat(CHATML, long, add_generation_prompt=True)  # 4 MB of conversation: the bounds grow with it
    assert text.count("<|im_start|>") == 42 and all(m["content"] in text for m in long)
    assert "turn 39" in render_chat(QWEN3, long, add_generation_prompt=True)


def test_the_limits_are_the_bounds_given() -> None:
    template = BoundedEnvironment().from_string("{% for i in range(n) %}{{ 'ab' * k }}{% endfor %}")
    assert render_bounded(template, Bounds(), {"n": 3, "k": 2}) == "abab" * 3
    with pytest.raises(TemplateLimitError, match="at most 10$"):
        render_bounded(template, Bounds(chars=10), {"n": 1, "k": 6})
    with pytest.raises(TemplateLimitError, match="at most 5$"):
        render_bounded(template, Bounds(items=5), {"n": 6, "k": 1})
    with pytest.raises(TemplateLimitError, match="time limit of 0.05 s"):
        render_bounded(BoundedEnvironment().from_string("{% for i in range(99999) %}{% for j in range(99999) %}"
                                                        "{% endfor %}{% endfor %}"), Bounds(seconds=0.05), {})
