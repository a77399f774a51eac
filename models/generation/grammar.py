"""What a constrained output must match, and that constraint compiled for a vocabulary (llguidance; why it and not
xgrammar: docs/structured-outputs.md).

- ``Constraint`` — ``Constraint.json_schema(schema)``, ``.json_object()``, ``.regex(pattern)``,
  ``.grammar(lark_or_gbnf)``, ``.choice([...])``: a small frozen, hashable, picklable value (it crosses the pipe to
  an engine process); ``check()`` validates it without a tokenizer.
- ``compile_constraint(constraint, tokenizer, vocab_size, eos)`` — the constraint bound to a vocabulary: compiled
  once per distinct (tokenizer, vocabulary, EOS, constraint) and cached; ``.start()`` gives a fresh
  ``ConstraintState`` (one per decoded row).
- ``ConstraintState`` — one row's position in the grammar: ``fill`` its bitmask, ``advance`` with the chosen token,
  ``rollback`` (speculative decoding), ``copy`` (``n > 1`` samples).

The batch side (bitmasks filled for every row, applied to the logits) is ``models.generation.constraints``, which
re-exports these names.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: The kinds of constraint, as ``Constraint.kind``.
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


#: JSON output without optional whitespace: a model cannot spend its tokens on spaces and newlines.
JSON_OPTIONS = {"whitespace_flexible": False}


#: Compiled constraints kept per process (least recently used dropped first).
CACHE_SIZE = 256


def library() -> Any:
    """The ``llguidance`` module, imported on first use (the ``structured`` extra).

    Returns:
        The imported ``llguidance`` module.

    Raises:
        ImportError: llguidance is not installed, with the command that installs it.
    """
    try:
        import llguidance
        import llguidance.gbnf_to_lark  # (not llguidance.torch: it imports torch._dynamo, seconds, for nothing here)
    except ImportError as err:
        raise ImportError("constrained decoding needs llguidance: pip install 'transformer-zoo[structured]'") from err
    return llguidance


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a constrained output must match (see the module docstring for the constructors).

    Attributes:
        kind: one of ``KINDS``.
        value: the schema as canonical JSON text (``json_schema``), the pattern (``regex``), the grammar text
            (``grammar``), the strings (``choice``, a tuple), or None (``json_object``).
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind {self.kind!r} is not one of {KINDS}")

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """Output that is JSON valid under ``schema`` (a dict, its JSON text, or a pydantic model class).

        Args:
            schema: the JSON schema: a dict, its JSON text, or a pydantic model class.

        Returns:
            The constraint, holding the schema as canonical JSON text.

        Raises:
            ValueError: ``schema`` is not a JSON object (or its text).
        """
        if hasattr(schema, "model_json_schema"):
            schema = schema.model_json_schema()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"json_schema is not valid JSON: {err}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is any JSON object.

        Returns:
            The ``json_object`` constraint.
        """
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` whole (Rust ``regex`` syntax, as Python's for common patterns).

        Args:
            pattern: the regular expression (anchored at both ends: the whole output must match).

        Returns:
            The ``regex`` constraint (the pattern is compiled, and checked, by ``check`` or ``compile_constraint``).

        Raises:
            ValueError: ``pattern`` is not a string.
        """
        if not isinstance(pattern, str):
            raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> Constraint:
        """Output that the grammar derives from its ``start`` rule (Lark syntax, or GBNF with ``root ::= ...``).

        Args:
            text: the grammar's text.

        Returns:
            The ``grammar`` constraint (parsed, and checked, by ``check`` or ``compile_constraint``).

        Raises:
            ValueError: ``text`` is not a non-empty string.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"grammar must be a non-empty string, got {text!r}")
        return cls("grammar", text)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """Output that is exactly one of ``options``.

        Args:
            options: the strings allowed.

        Returns:
            The ``choice`` constraint, holding the options as a tuple.

        Raises:
            ValueError: not a non-empty list of non-empty strings.
        """
        if isinstance(options, str) or not isinstance(options, Sequence) or not options or not all(
                isinstance(o, str) and o for o in options):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got {options!r:.80}")
        return cls("choice", tuple(options))

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (JSON text).

        Returns:
            The grammar text that ``llguidance.LLMatcher`` takes.
        """
        if self.kind == "json_schema":
            return library().LLMatcher.grammar_from_json_schema(self.value, overrides=JSON_OPTIONS)
        if self.kind == "json_object":
            return library().LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return library().LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            # JSON string literals are Lark string literals: every character of an option is taken as it is.
            return library().LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in self.value))
        return library().LLMatcher.grammar_from_lark(library().gbnf_to_lark.any_to_lark(self.value))

    def check(self) -> None:
        """Validate the constraint (no tokenizer needed).

        Raises:
            ValueError: naming the kind and what is wrong (an invalid schema, pattern or grammar).
        """
        try:
            text = self.grammar_text()
        except (ValueError, TypeError) as err:
            raise ValueError(f"invalid {self.kind}: {err}") from None
        error = library().LLMatcher.validate_grammar(text)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {self.kind}: {error.strip()}")


class ConstraintState:
    """One decoded row's position in its constraint's grammar.

    Args:
        matcher: the row's ``llguidance.LLMatcher``.
    """

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: Tensor, row: int = 0) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32, bit ``j % 32`` of word ``j // 32``).

        Args:
            bitmask: the batch's bitmask (``new_bitmask``), written in place by llguidance through its pointer.
            row: the row of ``bitmask`` that is this state's.

        Raises:
            ValueError: ``bitmask`` is not a contiguous int32 CPU tensor (llguidance writes raw memory).

        Shapes: bitmask ``(B, ceil(V / 32))`` int32.
        """
        target = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not target.is_contiguous():
            raise ValueError(f"bitmask must be a contiguous int32 CPU tensor, got {bitmask.dtype} on {bitmask.device}")
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def advance(self, token: int) -> None:
        """Take the chosen token.

        Args:
            token: the token chosen for this row.

        Raises:
            ValueError: the token is not allowed here (it was not chosen under this state's mask).
        """
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} does not continue the constraint: {self.matcher.get_error()}")

    def allows(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a draft), taken in order from here, the grammar accepts (nothing is taken).

        Args:
            tokens: the proposed tokens, in order.

        Returns:
            The length of the longest accepted prefix of ``tokens``.
        """
        return self.matcher.validate_tokens([int(t) for t in tokens])

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` tokens taken.

        Args:
            n: how many tokens to undo (0 does nothing).

        Raises:
            ValueError: the matcher cannot roll back ``n`` tokens.
        """
        if n and not self.matcher.rollback(n):
            raise ValueError(f"cannot roll back {n} tokens: {self.matcher.get_error()}")

    def copy(self) -> ConstraintState:
        """An independent state at the same position (for another sample of the same request).

        Returns:
            A new ``ConstraintState`` over a deep copy of the matcher.
        """
        return ConstraintState(self.matcher.deep_copy())

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete and takes nothing but EOS now."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete match (EOS is allowed)."""
        return self.matcher.is_accepting()


@dataclasses.dataclass(frozen=True)
class CompiledConstraint:
    """A ``Constraint`` compiled for one vocabulary (``compile_constraint``); ``start()`` for each row.

    Attributes:
        constraint: the constraint compiled.
        template: the matcher at the start of the grammar, copied for each row.
        vocab_size: the model's number of logits.
    """

    constraint: Constraint
    template: Any  # the matcher at the start, copied for each row
    vocab_size: int

    def start(self) -> ConstraintState:
        """A fresh state at the start of the grammar.

        Returns:
            A ``ConstraintState`` over a copy of the template matcher.
        """
        return ConstraintState(self.template.deep_copy())


_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_COMPILED: collections.OrderedDict = collections.OrderedDict()


_LOCK = threading.Lock()


def vocabulary(tokenizer: Any, vocab_size: int, eos: int) -> Any:
    """llguidance's view of ``tokenizer`` (a ``tokenization.Tokenizer`` or a ``tokenizers.Tokenizer``) for a model
    of ``vocab_size`` logits ending with ``eos``; built once per tokenizer object (~0.4 s for 49k tokens).

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's number of logits (it may exceed the tokenizer's size: the padding ids are never
            allowed).
        eos: the token that ends a complete output.

    Returns:
        The ``llguidance.LLTokenizer`` (cached per tokenizer, vocabulary size and EOS).

    Raises:
        ValueError: a tokenizer that wraps no ``tokenizers.Tokenizer``, or one larger than the model's vocabulary.
    """
    backend = getattr(tokenizer, "backend", tokenizer)
    if not hasattr(backend, "to_str"):
        raise ValueError(f"constrained decoding needs a tokenizer over the `tokenizers` library, got "
                         f"{type(tokenizer).__name__}")
    per_tokenizer = _TOKENIZERS.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in per_tokenizer:
        size = backend.get_vocab_size(with_added_tokens=True)
        if size > vocab_size:
            raise ValueError(f"the tokenizer has {size} tokens but the model only {vocab_size} logits")
        per_tokenizer[key] = library().LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    return per_tokenizer[key]


def compile_constraint(constraint: Constraint | CompiledConstraint, tokenizer: Any, vocab_size: int,
                       eos: int | None) -> CompiledConstraint:
    """``constraint`` compiled for the tokenizer's vocabulary (cached: the same constraint compiles once).

    Args:
        constraint: what the output must match (a ``CompiledConstraint`` is returned as it is).
        tokenizer: the model's tokenizer.
        vocab_size: the model's number of logits.
        eos: the token that ends a complete output.

    Returns:
        The compiled constraint.

    Raises:
        ValueError: no EOS token, or an invalid constraint (naming its kind).
    """
    if isinstance(constraint, CompiledConstraint):
        return constraint
    if not isinstance(constraint, Constraint):
        raise ValueError(f"constraint must be a Constraint, got {type(constraint).__name__}")
    if eos is None:
        raise ValueError("constrained decoding needs an EOS token to end a complete output; the model has none")
    with _LOCK:
        vocab = vocabulary(tokenizer, vocab_size, eos)
        key = (id(vocab), constraint)
        if key in _COMPILED and _COMPILED[key][0] is vocab:
            _COMPILED.move_to_end(key)
            return _COMPILED[key][1]
    constraint.check()
    matcher = library().LLMatcher(vocab, constraint.grammar_text(), log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid {constraint.kind}: {matcher.get_error()}")
    compiled = CompiledConstraint(constraint, matcher, vocab_size)
    with _LOCK:
        _COMPILED[key] = (vocab, compiled)
        while len(_COMPILED) > CACHE_SIZE:
            _COMPILED.popitem(last=False)
    return compiled
