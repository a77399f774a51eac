"""MkDocs hook: a ```` ```python notest ```` fence (a block ``make test`` compiles but does not run) and a
```` ```python slow ```` fence (one only ``make test-all`` runs, see ``tests/test_docs.py``) render as ordinary Python
blocks."""

from __future__ import annotations

import re
from typing import Any

NOTEST = re.compile(r"^(?P<fence>[ \t]*`{3,}python)[ \t]+(?:notest|slow)[ \t]*$", re.M)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Drop the ``notest`` and ``slow`` words from fence info strings before the page is rendered.

    Args:
        markdown: the page's Markdown source.
        **kwargs: what MkDocs passes to every hook (page, config, files), unused.

    Returns:
        The source with every ```` ```python notest ```` and ```` ```python slow ```` fence written
        ```` ```python ````.
    """
    return NOTEST.sub(r"\g<fence>", markdown)
