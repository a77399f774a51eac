"""Reading a ``transformers`` checkpoint: its config.json with the family's defaults, and its state dict.

Both readers exist so that every converter reports problems the same way: a config value the zoo cannot
represent names the field and the feature; a missing, leftover or ill-shaped tensor names the key. The state-dict
reader is ``models.convert.checkpoint_reader.CheckpointReader``, re-exported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from ..core.config import ConfigBase
from .checkpoint_reader import CheckpointReader

__all__ = ["ACTIVATIONS", "CheckpointReader", "HFConfig", "rope_parameters", "zoo_config"]

C = TypeVar("C", bound=ConfigBase)

# transformers' ACT2FN names whose function a registered zoo FFN computes (up to float rounding):
# "gelu"/"gelu_python" are the erf form; the tanh approximations differ only in how the constant is written.
ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

_MISSING = object()


class HFConfig:
    """A read-only view of a ``transformers`` config dict in which absent fields take the family's defaults.

    Args:
        model_type: the family (for messages).
        data: the config.json dict.
        defaults: the family's defaults in the installed ``transformers`` version, for every field read.
        aliases: field -> the generic name ``transformers`` also accepts for it (the config class's
            ``attribute_map``, e.g. GPT-2's ``hidden_size`` for ``n_embd``); the field's own name wins.
    """

    def __init__(
        self,
        model_type: str,
        data: Mapping[str, Any],
        defaults: Mapping[str, Any],
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        self.model_type = model_type
        self.data = dict(data)
        for field, alias in (aliases or {}).items():
            if field not in self.data and alias in self.data:
                self.data[field] = self.data[alias]
        self.defaults = defaults

    def __getitem__(self, key: str) -> Any:
        value = self.data.get(key, _MISSING)
        return self.defaults[key] if value is _MISSING else value

    def unsupported(self, key: str, feature: str, supported: str) -> ValueError:
        """The error for a field whose value the zoo cannot represent.

        Args:
            key: the field.
            feature: what the field controls (for the message).
            supported: the values the zoo represents (for the message).

        Returns:
            The error to raise, naming the field, its value and what is supported.
        """
        return ValueError(
            f"{self.model_type} checkpoint has {key}={self[key]!r} ({feature}); the zoo represents only "
            f"{supported}, so it cannot load this model exactly"
        )

    def require(self, key: str, allowed: Iterable[Any], feature: str) -> None:
        """Raise ``ValueError`` unless the field's value (or its default) is one of ``allowed``.

        Args:
            key: the field.
            allowed: the values the zoo represents (compared with their types: ``True`` is not ``1``).
            feature: what the field controls (for the message).

        Raises:
            ValueError: another value (``unsupported``).
        """
        allowed = tuple(allowed)
        if not any(self[key] == a and type(self[key]) is type(a) for a in allowed):
            raise self.unsupported(key, feature, " or ".join(f"{key}={a!r}" for a in allowed))

    def require_legacy(self, key: str, allowed: Iterable[Any], feature: str) -> None:
        """Like ``require`` for a field older ``transformers`` versions wrote; absent (or null) means fine.

        Args:
            key: the field.
            allowed: the values the zoo represents.
            feature: what the field controls (for the message).
        """
        if key in self.data and self.data[key] is not None:
            self.require(key, allowed, feature)

    def positive_int(self, key: str) -> int:
        """The field as a positive int, or a ``ValueError`` naming it.

        Args:
            key: the field.

        Returns:
            Its value.

        Raises:
            ValueError: not an integer >= 1 (a bool included).
        """
        value = self[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{self.model_type} config field {key} must be a positive integer, got {value!r}")
        return value

    def boolean(self, key: str) -> bool:
        """The field as a JSON boolean.

        Args:
            key: the field.

        Returns:
            Its value.

        Raises:
            ValueError: not ``true``/``false`` (``"yes"``, ``1``, ``null``), naming the field.
        """
        value = self[key]
        if not isinstance(value, bool):
            raise ValueError(f"{self.model_type} config field {key} must be true or false, got {value!r}")
        return value

    def probability(self, key: str) -> float:
        """The field as a dropout probability in [0, 1).

        Args:
            key: the field.

        Returns:
            Its value as a float.

        Raises:
            ValueError: not a number in [0, 1) (a bool included), naming the field.
        """
        value = self[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"{self.model_type} config field {key} must be a probability in [0, 1), got {value!r}")
        return float(value)

    def activation(self, key: str) -> str:
        """The registry name of the zoo FFN computing the activation named by the field (``ACTIVATIONS``).

        Args:
            key: the field (``hidden_act``, ``activation_function`` ...).

        Returns:
            The zoo's name (``"gelu_tanh"`` for ``gelu_new``).

        Raises:
            ValueError: an activation no zoo FFN computes (``unsupported``).
        """
        value = self[key]
        if value not in ACTIVATIONS:
            raise self.unsupported(
                key, "the feed-forward activation", "the activations " + ", ".join(sorted(ACTIVATIONS))
            )
        return ACTIVATIONS[value]

    def token_id(self, key: str, vocab_size: int | None = None) -> int | None:
        """A special-token id; a one-element list (as some configs write eos) counts as that id.

        An id outside ``[0, vocab_size)`` (GPT2Config's default 50256 in a tiny test checkpoint) names no token
        of this model: it becomes None with a warning (the logits do not depend on it).

        Args:
            key: the field (``eos_token_id`` ...).
            vocab_size: the model's vocabulary size, or None not to check the range.

        Returns:
            The id, or None (absent, null, or outside the vocabulary).

        Raises:
            ValueError: neither an integer, a one-element list of one, nor null (``unsupported``).
        """
        value = self[key]
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.unsupported(key, "special token ids", "a single integer id or null")
        if value is not None and vocab_size is not None and not 0 <= value < vocab_size:
            warnings.warn(
                f"{self.model_type} checkpoint has {key}={value}, outside its vocabulary of {vocab_size} tokens; "
                f"loading it with {key}=None",
                stacklevel=3,
            )
            return None
        return value

    def token_ids(self, *keys: str, vocab_key: str = "vocab_size") -> dict[str, int | None]:
        """``{key: token_id(key, vocab size)}`` for several special-token fields.

        Args:
            *keys: the fields.
            vocab_key: the field holding the vocabulary size the ids are checked against.

        Returns:
            The ids by field (None where absent or out of range).
        """
        return {key: self.token_id(key, self[vocab_key]) for key in keys}

    def rope_options(self, default_theta: float, parameters: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The zoo rotary options (``base``, ``fraction``, ``scaling``) of the checkpoint's RoPE settings.

        Reads both config formats: ``rope_parameters`` (transformers 5; pass a nested entry as ``parameters``) and
        the older ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` fields.

        Args:
            default_theta: the family's base when the checkpoint names none.
            parameters: a nested RoPE entry to read instead of the top-level fields (Gemma 3's per-attention-type
                ``rope_parameters``), or None.

        Returns:
            The options of the zoo's ``rotary`` positional block: ``base``, and ``fraction`` and ``scaling`` where
            the checkpoint sets them.

        Raises:
            ValueError: a RoPE type other than default, ``linear``, ``llama3``, ``yarn`` and ``longrope`` (e.g.
                ``dynamic``), named, since the zoo would compute different angles.
        """
        data = self.data
        if parameters is None:
            # As transformers reads them: an (old-style) rope_scaling replaces rope_parameters.
            for key in ("rope_scaling", "rope_parameters"):
                if data.get(key) is not None and not isinstance(data[key], Mapping):
                    raise ValueError(f"{self.model_type} config field {key} must be an object (e.g. "
                                     f"{{\"rope_type\": \"linear\", \"factor\": 2.0}}) or null, got {data[key]!r}")
            parameters = dict(data.get("rope_scaling") or data.get("rope_parameters") or {})
        elif not isinstance(parameters, Mapping):
            raise ValueError(f"{self.model_type} RoPE parameters must be an object, got {parameters!r}")
        theta = parameters.get("rope_theta", data.get("rope_theta", default_theta))
        fraction = parameters.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
        kind = parameters.get("rope_type", parameters.get("type", "default"))
        options: dict[str, Any] = {"base": float(theta)}
        if fraction is not None and float(fraction) != 1.0:
            options["fraction"] = float(fraction)
        try:
            if kind == "linear":
                options["scaling"] = {"type": "linear", "factor": float(parameters["factor"])}
            elif kind == "llama3":
                options["scaling"] = {
                    "type": "llama3", "factor": float(parameters["factor"]),
                    "low_freq_factor": float(parameters["low_freq_factor"]),
                    "high_freq_factor": float(parameters["high_freq_factor"]),
                    "original_max_len": int(parameters["original_max_position_embeddings"]),
                }
            elif kind in ("yarn", "longrope"):
                options["scaling"] = self.scaled_rope(kind, parameters)
            elif kind != "default":
                raise ValueError(
                    f"{self.model_type} checkpoint has rope_type={kind!r} (RoPE frequency scaling); the zoo "
                    "represents the default, 'linear', 'llama3', 'yarn' and 'longrope' types, so it cannot load "
                    "this model exactly"
                )
        except KeyError as err:
            raise ValueError(f"{self.model_type} checkpoint's {kind!r} RoPE scaling lacks {err}") from err
        return options

    def scaled_rope(self, kind: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        """The zoo's ``yarn`` / ``longrope`` scaling of a checkpoint's RoPE parameters (the optional keys only
        where the checkpoint sets them; ``original_max_position_embeddings`` may sit at the top level).

        Args:
            kind: ``"yarn"`` or ``"longrope"``.
            parameters: the checkpoint's RoPE parameters.

        Returns:
            The zoo's ``scaling`` option (``type``, ``original_max_len``, the factors).

        Raises:
            ValueError: a longrope ``original_max_position_embeddings`` beyond ``max_position_embeddings``.
            KeyError: a required key is missing (``rope_options`` turns it into a ``ValueError`` naming it).
        """
        data = self.data
        original = parameters.get("original_max_position_embeddings",
                                  data.get("original_max_position_embeddings", data.get("max_position_embeddings")))
        scaling: dict[str, Any] = {"type": kind, "original_max_len": int(original)}
        factor = parameters.get("factor")
        if kind == "yarn":
            scaling["factor"] = float(data["max_position_embeddings"] / original if factor is None else factor)
            for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
                if parameters.get(key) is not None:
                    scaling[key] = float(parameters[key])
            if parameters.get("truncate") is not None:
                scaling["truncate"] = bool(parameters["truncate"])
            return scaling
        largest = data.get("max_position_embeddings")
        if isinstance(largest, int) and int(original) > largest:
            raise ValueError(f"{self.model_type} checkpoint's longrope original_max_position_embeddings={original} "
                             f"exceeds max_position_embeddings={largest}: the scaled context must be the longer one")
        scaling.update(short_factor=[float(v) for v in parameters["short_factor"]],
                       long_factor=[float(v) for v in parameters["long_factor"]])
        if factor is not None:
            scaling["factor"] = float(factor)
        if parameters.get("attention_factor") is not None:
            scaling["attention_factor"] = float(parameters["attention_factor"])
        return scaling

    def warn_training_only(self, key: str, zoo_value: float, what: str) -> None:
        """Warn that a field which only matters in training is approximated (eval-mode outputs are exact).

        Args:
            key: the field.
            zoo_value: the value the zoo model uses instead.
            what: what the field controls (for the warning).
        """
        if self[key] != zoo_value:
            warnings.warn(
                f"{self.model_type} checkpoint has {key}={self[key]!r} but the zoo model uses {zoo_value!r} for "
                f"{what}; this changes training only (outputs in eval mode are identical)",
                stacklevel=4,
            )


def zoo_config(model_type: str, config_class: type[C], **fields: Any) -> C:
    """Build the zoo config a checkpoint maps to, naming the checkpoint if the zoo rejects a value.

    Args:
        model_type: the family (for the message).
        config_class: the zoo config class.
        **fields: its fields.

    Returns:
        The config.

    Raises:
        ValueError: the config class rejects a value.
    """
    try:
        return config_class(**fields)
    except ValueError as err:
        raise ValueError(f"{model_type} checkpoint maps to an invalid {config_class.__name__}: {err}") from err


def rope_parameters(rotary: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` of a ``transformers`` config for the zoo rotary options ``rotary`` (``base``,
    ``fraction``, ``scaling``): the inverse of ``HFConfig.rope_options``.

    Args:
        rotary: the zoo rotary options.

    Returns:
        The ``rope_parameters`` dict (``rope_type``, ``rope_theta`` and the scaling's fields).
    """
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rotary.get("base", 10000.0)}
    scaling = dict(rotary.get("scaling") or {})
    if scaling:
        rope["rope_type"] = scaling.pop("type")
        if "original_max_len" in scaling:
            rope["original_max_position_embeddings"] = scaling.pop("original_max_len")
        rope.update(scaling)
    if "fraction" in rotary:
        rope["partial_rotary_factor"] = rotary["fraction"]
    return rope

