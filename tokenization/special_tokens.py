"""Special-token roles: which token plays padding, unknown, begin, end and mask.

A standard ``tokenizer.json`` lists its special tokens but not their roles. Roles come, in order of
precedence, from an explicit mapping, from a Hugging Face ``tokenizer_config.json`` next to the file,
or from the conventional names below (``[PAD]``, ``<pad>``, ``<|endoftext|>`` ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROLES = ("pad", "unk", "bos", "eos", "mask")

# Order fixes the ids of a freshly trained tokenizer: [PAD]=0, [UNK]=1, [BOS]=2, [EOS]=3, [MASK]=4, matching
# the models' config defaults (pad_token_id=0, bos_token_id=2, eos_token_id=3, mask_token_id=4).
DEFAULT_SPECIAL_TOKENS: dict[str, str] = {
    "pad": "[PAD]", "unk": "[UNK]", "bos": "[BOS]", "eos": "[EOS]", "mask": "[MASK]",
}

# Conventional names, most specific first; used only when nothing says which token plays a role.
CONVENTIONAL_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("[PAD]", "<pad>", "<|pad|>", "<|padding|>"),
    "unk": ("[UNK]", "<unk>", "<|unk|>"),
    "bos": ("[BOS]", "<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>", "[CLS]", "<|endoftext|>"),
    "eos": ("[EOS]", "</s>", "<eos>", "<|end_of_text|>", "<|endoftext|>", "[SEP]"),
    "mask": ("[MASK]", "<mask>", "<|mask|>"),
}

CONFIG_FILE = "tokenizer_config.json"


def check_special_tokens(special_tokens: Mapping[str, str | None]) -> dict[str, str | None]:
    """Validate a role -> token mapping and return it as a plain dict.

    Args:
        special_tokens: keys among ``ROLES``; values non-empty strings (or None: no token for that role).

    Returns:
        A dict with the same items.

    Raises:
        ValueError: an unknown role, or an empty or non-string token.
    """
    if not isinstance(special_tokens, Mapping):
        raise ValueError(f"special_tokens must be a mapping role -> token, got {type(special_tokens).__name__}")
    unknown = sorted(set(special_tokens) - set(ROLES))
    if unknown:
        raise ValueError(f"unknown special-token role(s) {unknown}; expected roles among {list(ROLES)}")
    # One token may play several roles (GPT-2's <|endoftext|> is bos, eos and unk), so repeats are allowed here;
    # training, which gives every listed token its own id, rejects them.
    for role, token in special_tokens.items():
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError(f"special token for role {role!r} must be a non-empty string or None, got {token!r}")
    return dict(special_tokens)


def read_config(tokenizer_file: Path) -> dict[str, Any]:
    """The Hugging Face ``tokenizer_config.json`` beside ``tokenizer_file`` (empty if there is none).

    Args:
        tokenizer_file: the ``tokenizer.json`` whose folder is read.

    Returns:
        The parsed config.

    Raises:
        ValueError: the file is not UTF-8 JSON (nested beyond the parser's recursion limit included) or not an
            object; the file is named.
    """
    config_path = tokenizer_file.with_name(CONFIG_FILE)
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError; nesting beyond the
        # interpreter's recursion limit (~1,000 levels; the parser stops there without allocating more)
        raise ValueError(f"{config_path} is not valid JSON: {type(err).__name__}: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def roles_from_config(config: Mapping[str, Any]) -> dict[str, str]:
    """Roles named by a Hugging Face ``tokenizer_config.json`` (``read_config``).

    Args:
        config: the parsed config.

    Returns:
        Role -> token string, for the roles the config names.
    """
    roles: dict[str, str] = {}
    for role in ROLES:
        value: Any = config.get(f"{role}_token")
        # transformers writes either the token string or a serialised AddedToken with a "content" field.
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            roles[role] = value
    return roles


def write_config(tokenizer_file: Path, roles: Mapping[str, str | None]) -> None:
    """Write the roles as a ``tokenizer_config.json`` beside ``tokenizer_file`` (the transformers format).

    Args:
        tokenizer_file: the ``tokenizer.json`` beside which to write.
        roles: role -> token string (None: no token for the role).
    """
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for role in ROLES:
        if roles.get(role) is not None:
            config[f"{role}_token"] = roles[role]
    tokenizer_file.with_name(CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
