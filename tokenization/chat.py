"""Chat templates: a conversation rendered to the prompt text a chat model was trained on.

A chat template is a Jinja template shipped with the tokenizer (``chat_template`` in ``tokenizer_config.json``, a
``chat_template.jinja`` file beside it, or ``tokenizer.chat_template`` in a GGUF file). It is rendered as
``transformers``' ``apply_chat_template`` renders it, because that is what the templates are written for:

- jinja2's ``ImmutableSandboxedEnvironment`` (templates come from the Hub: untrusted code), ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension, and a ``{% generation %}`` block that renders its body;
- ``raise_exception(message)``, ``strftime_now(format)``, ``tojson`` without ASCII or HTML escaping, a ``dict``
  constructor and a ``namespace`` that refuses underscore names;
- the context: ``messages`` (keys whose value is None dropped), ``tools``, ``documents``,
  ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token`` …) and any extra keyword;
- ``continue_final_message``: the last message is left open (the text after its content is cut), so the model
  continues it.

Every value the template sees is rebuilt from plain JSON types first (objects with methods of their own could
otherwise reach the sandbox). The rendering is bounded in time and memory while it runs (``tokenization.
template_bounds``: a template may not loop for ever or build gigabytes), and a template is rendered alone
(``include``, ``import`` and ``extends`` are refused). A template that raises, does not parse, breaks the sandbox or
reaches a limit gives a ``ValueError`` naming the problem and the template's line.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import traceback
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from .template_bounds import BoundedEnvironment, render_bounded
from .template_budget import Bounds, TemplateLimitError, charge, deep_size

#: The file a template is saved to beside ``tokenizer.json`` (what ``transformers`` writes and reads).
TEMPLATE_FILE = "chat_template.jinja"
#: The largest template read from a file (real ones are under 20 KB).
MAX_TEMPLATE_CHARS = 1 << 20
#: The most Jinja tokens a template may have (Qwen3's has 591; compiling 12288 takes about a second at worst).
MAX_TEMPLATE_TOKENS = 12288

# Marks the end of the final message for continue_final_message (transformers' tag, so that cuts agree).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
#: While set to a ``(start, end)`` pair of strings, ``{% generation %}`` blocks render their body between them
#: (``tokenization.chat_spans`` finds the assistant's text so); unset, they render the body alone.
GENERATION_MARKS: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("generation_marks",
                                                                                         default=None)


class _Generation(jinja2.ext.Extension):
    """``{% generation %} … {% endgeneration %}``: marks the assistant's text in training templates; renders its
    body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        marks = GENERATION_MARKS.get()
        return caller() if marks is None else marks[0] + caller() + marks[1]


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` without underscore attributes (no route to the interpreter's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, charge(value, f"the namespace attribute {name!r}"))

    @staticmethod
    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled in the bounded sandbox (cached by its text).

    Args:
        template: the Jinja source.

    Returns:
        The compiled template.

    Raises:
        ValueError: the template does not parse (jinja2's message and line), is over ``MAX_TEMPLATE_CHARS`` or
            ``MAX_TEMPLATE_TOKENS``, or
            includes, imports or extends another template (a chat template is rendered alone).
    """
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"the chat template has {len(template)} characters; expected at most {MAX_TEMPLATE_CHARS}")
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    try:
        for count, _ in enumerate(env.lex(template), 1):  # compiling takes ~60 µs a token: a bound on the time too
            if count > MAX_TEMPLATE_TOKENS:
                raise ValueError(f"the chat template has over {MAX_TEMPLATE_TOKENS} Jinja tokens; expected at most "
                                 f"{MAX_TEMPLATE_TOKENS} (real templates have a few thousand)")
        tree = env.parse(template)
        for kind, tag in _ALONE:
            node = next(tree.find_all(kind), None)
            if node is not None:
                raise ValueError(f"the chat template uses {{% {tag} %}} (line {node.lineno}): a chat template is "
                                 "rendered alone, with no other template to load")
        return env.from_string(tree)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse: {err.message} (line {err.lineno})") from err
    except (RecursionError, MemoryError, OverflowError) as err:
        raise ValueError(f"the chat template does not compile: {type(err).__name__}: {err}") from err


_ALONE = ((jinja2.nodes.Include, "include"), (jinja2.nodes.Import, "import"), (jinja2.nodes.FromImport, "from import"),
          (jinja2.nodes.Extends, "extends"))


def _where(err: BaseException, template: str) -> str:
    """The template line an exception was raised at (jinja2 rewrites tracebacks to template lines), quoted."""
    line = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        if frame.f_code.co_filename == "<template>":
            line = lineno
    if line is None:
        return "the template"
    lines = template.splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return f"line {line} ({text[:80]!r})"


def plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (subclasses stripped to their base type, dataclasses and pydantic
    models as dicts); anything else becomes a placeholder naming its type, e.g. ``"<ndarray>"``.

    Args:
        value: what a caller passed into a template (messages, tools, documents, context).

    Returns:
        The plain copy.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}")
    out = []
    for i, message in enumerate(plain(list(messages))):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}  # content=None: as if absent
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # older names of a message's reasoning, under the one templates read
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **context: Any,
) -> str:
    """Render one conversation with ``template``.

    Args:
        template: the Jinja chat template.
        messages: ``[{"role": ..., "content": ...}, ...]`` (other keys, e.g. ``tool_calls``, are passed through).
        add_generation_prompt: end with the header that opens the assistant's turn.
        continue_final_message: leave the final message open for the model to continue (not with
            ``add_generation_prompt``).
        tools: JSON schemas of tools, for templates that use them.
        documents: ``{"title", "text"}`` documents, for templates that use them.
        context: further names for the template (the special tokens, ``enable_thinking`` …).

    Returns:
        The rendered prompt text.

    Raises:
        ValueError: bad messages, tools or documents; both generation flags; a template that raises
            (``raise_exception``), breaks the sandbox or drops the final message it was to continue.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"chat template must be a non-empty string, got {template!r}")
    chat = _check_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are exclusive: continue the final "
                         "message, or open a new assistant turn")
    for name, items in (("tools", tools), ("documents", documents)):
        if items is not None and not all(isinstance(item, Mapping) for item in items):
            raise ValueError(f"{name} must be a list of dicts (JSON schemas / {{'title', 'text'}}), got {items!r}")
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise ValueError(f"continue_final_message needs a final message with string content, got {final!r}")
        fields = [k for k in ("content", *_REASONING_FIELDS) if chat[-1].get(k) == final] or ["content"]
        for field in fields:
            chat[-1][field] = final + _CONTINUE_TAG
    values = dict(messages=chat, tools=plain(tools), documents=plain(documents),
                  add_generation_prompt=bool(add_generation_prompt), **plain(dict(context)))
    compiled = compile_template(template)
    try:
        text = render_bounded(compiled, Bounds().widened(deep_size(values, 1 << 40)[0]), values)
    except TemplateLimitError as err:
        raise ValueError(f"the chat template went past a limit at {_where(err, template)}: {err}") from err
    except jinja2.exceptions.SecurityError as err:
        raise ValueError(f"the chat template broke the sandbox at {_where(err, template)}: {err}") from err
    except jinja2.exceptions.TemplateError as err:
        raise ValueError(f"the chat template raised: {err} (at {_where(err, template)})") from err
    except Exception as err:  # noqa: BLE001 - TypeError, OverflowError, RecursionError …: the template's failure
        raise ValueError(f"the chat template failed at {_where(err, template)}: {type(err).__name__}: {err}") from err
    if final is not None:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message: the rendered chat does not contain the final message "
                             f"{final.strip()!r} (the template drops or rewrites it)")
        at = text.rindex(tag)
        text = text[:at] if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def read_template(tokenizer_file: Path, config: Mapping[str, Any] | None) -> str | None:
    """The chat template saved with a tokenizer: ``chat_template.jinja`` beside ``tokenizer_file``, else
    ``chat_template`` in its ``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}`` of which
    the one named ``default`` is taken), else None.

    Args:
        tokenizer_file: the ``tokenizer.json`` the template belongs to.
        config: its parsed ``tokenizer_config.json`` (``read_config``), or None.

    Returns:
        The template text, or None.

    Raises:
        ValueError: a template file over ``MAX_TEMPLATE_CHARS`` or not UTF-8, or a config value of another shape.
    """
    path = tokenizer_file.with_name(TEMPLATE_FILE)
    if path.is_file():
        if path.stat().st_size > MAX_TEMPLATE_CHARS:
            raise ValueError(f"{path} holds {path.stat().st_size} bytes; expected at most {MAX_TEMPLATE_CHARS}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} is not UTF-8 text: {err}") from err
    value = (config or {}).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default")
    raise ValueError(f"chat_template in the tokenizer_config.json beside {tokenizer_file} must be a string or a "
                     f"list of {{'name', 'template'}}, got {type(value).__name__}")


def write_template(tokenizer_file: Path, template: str | None) -> None:
    """Save ``template`` as ``chat_template.jinja`` beside ``tokenizer_file`` (removing a stale one if None).

    Args:
        tokenizer_file: the ``tokenizer.json`` the template belongs to.
        template: the template text, or None.
    """
    path = tokenizer_file.with_name(TEMPLATE_FILE)
    if template is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(template, encoding="utf-8")
