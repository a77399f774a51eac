"""``Tokenizer``: a thin layer on a ``tokenizers.Tokenizer`` that speaks the models' language.

It adds what the models need on top of the Rust tokenizer: special-token roles (pad, unk, bos, eos, mask)
with their ids, batch encoding to ``(B, L)`` tensors with the bool masks the models take (True = real
token), and ``tokenizer.json`` files that any Hugging Face tokenizer file can replace.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
import torch
from torch import Tensor

from .batch_encoding import as_text_batch, backend_settings, check_batch_options
from .chat import read_template, render_chat, write_template
from .special_tokens import (
    CONVENTIONAL_NAMES,
    ROLES,
    check_special_tokens,
    read_config,
    roles_from_config,
    write_config,
)
from .templates import template_processor


class Tokenizer:
    """A ``tokenizers.Tokenizer`` (``.backend``) plus special-token roles and tensor batching.

    Args:
        backend: the Rust tokenizer.
        special_tokens: role -> token string for roles among ``pad, unk, bos, eos, mask``; roles left out
            are found by their conventional names (``[PAD]``, ``<pad>``, ``<|endoftext|>`` ...), and a role
            mapped to None has no token.
        chat_template: the Jinja chat template (``apply_chat_template``), or None.

    Raises:
        ValueError: an unknown role, or a token that is not in the backend's vocabulary.
    """

    def __init__(self, backend: tokenizers.Tokenizer, special_tokens: Mapping[str, str | None] | None = None,
                 chat_template: str | None = None) -> None:
        if not isinstance(backend, tokenizers.Tokenizer):
            raise ValueError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a string (a Jinja template) or None, got {chat_template!r}")
        given = check_special_tokens(special_tokens or {})
        self.backend = backend
        self.chat_template = chat_template
        self._known_size = 0  # a vocabulary count ``_check_ids`` keeps (taken at its first use)
        self._roles: dict[str, str | None] = {}
        for role in ROLES:
            if role in given:
                token = given[role]
                if token is not None and backend.token_to_id(token) is None:
                    raise ValueError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
                self._roles[role] = token
            else:
                self._roles[role] = next(
                    (name for name in CONVENTIONAL_NAMES[role] if backend.token_to_id(name) is not None), None
                )

    # ------------------------------------------------------------------ files
    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], special_tokens: Mapping[str, str | None] | None = None
    ) -> Tokenizer:
        """Load a ``tokenizer.json`` (ours or any Hugging Face one).

        Roles come from ``special_tokens``, then from a ``tokenizer_config.json`` in the same folder, then
        from conventional names. The chat template comes from ``chat_template.jinja`` in the same folder, else
        from ``chat_template`` in ``tokenizer_config.json``.

        Args:
            path: the ``tokenizer.json`` file.
            special_tokens: role -> token string (``pad``, ``unk``, ``bos``, ``eos``, ``mask``), overriding the
                folder's ``tokenizer_config.json``.

        Returns:
            The tokenizer.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ValueError: the file is not a valid tokenizer.json.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {str(path)!r}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"{str(path)!r} is not a valid tokenizer.json: {err}") from err
        config = read_config(path)
        return cls(backend, {**roles_from_config(config), **(special_tokens or {})}, read_template(path, config))

    @classmethod
    def from_str(cls, json_str: str, special_tokens: Mapping[str, str | None] | None = None) -> Tokenizer:
        """Build from the JSON text of a ``tokenizer.json``.

        Args:
            json_str: the file's text.
            special_tokens: role -> token string (default: conventional names).

        Returns:
            The tokenizer.

        Raises:
            ValueError: the text is not a valid ``tokenizer.json``.
        """
        try:
            backend = tokenizers.Tokenizer.from_str(json_str)
        except Exception as err:
            raise ValueError(f"not a valid tokenizer.json: {err}") from err
        return cls(backend, special_tokens)

    def save(self, path: str | os.PathLike[str], *, write_roles: bool | None = None) -> None:
        """Write a standard ``tokenizer.json`` to ``path``.

        Args:
            path: the file to write (its folder must exist).
            write_roles: also write a Hugging Face ``tokenizer_config.json`` naming the special-token roles
                beside it, so that custom role names survive a reload (``transformers`` reads it too), and the
                chat template as ``chat_template.jinja``. Default: only when the file is called
                ``tokenizer.json``, i.e. it goes into a model folder.

        Raises:
            FileNotFoundError: the folder of ``path`` does not exist.
        """
        path = Path(path)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"cannot save to {str(path)!r}: folder {str(path.parent)!r} does not exist")
        self.backend.save(str(path))
        if write_roles if write_roles is not None else path.name == "tokenizer.json":
            write_config(path, self._roles)
            write_template(path, self.chat_template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = True,
        chat_template: str | None = None,
        **context: Any,
    ) -> list[int] | str:
        """A conversation as the prompt the model was trained on, as ``transformers``' ``apply_chat_template``
        renders it (``tokenization.chat``): token ids (``tokenize=True``; the template writes the special tokens,
        none are added) or the text.

        Args:
            messages: the conversation, ``{"role", "content"}`` dicts (see ``tokenization.chat.render_chat``).
            add_generation_prompt: end with the start of an assistant turn.
            continue_final_message: leave the last message open, for the model to continue.
            tools: JSON schemas of tools, for templates that use them.
            documents: ``{"title", "text"}`` documents, for templates that use them.
            tokenize: return token ids (True) or the rendered text (False).
            chat_template: a template to use instead of the tokenizer's own.
            context: further names for the template; the special tokens (``bos_token``, ``eos_token`` …) are
                there already.

        Returns:
            The prompt's token ids (``tokenize=True``) or its text.

        Raises:
            ValueError: no chat template, or as ``render_chat``.
        """
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template=... or load a tokenizer "
                             "whose folder has chat_template.jinja or a chat_template in tokenizer_config.json")
        names = {f"{role}_token": token for role, token in self._roles.items() if token is not None}
        text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools, documents=documents,
                           **{**names, **context})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def to_str(self) -> str:
        """The ``tokenizer.json`` text.

        Returns:
            The serialised tokenizer, as JSON text.
        """
        return self.backend.to_str()

    # ------------------------------------------------------------------ special tokens
    @property
    def special_tokens(self) -> dict[str, str | None]:
        """Role -> token string (None where the tokenizer has no token for the role)."""
        return dict(self._roles)

    def _role_id(self, role: str) -> int | None:
        token = self._roles[role]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def pad_token_id(self) -> int | None:
        return self._role_id("pad")

    @property
    def unk_token_id(self) -> int | None:
        return self._role_id("unk")

    @property
    def bos_token_id(self) -> int | None:
        return self._role_id("bos")

    @property
    def eos_token_id(self) -> int | None:
        return self._role_id("eos")

    @property
    def mask_token_id(self) -> int | None:
        return self._role_id("mask")

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of every special token (the roles' and any other token registered as special), sorted."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self._role_id(r) for r in ROLES) if i is not None)
        return sorted(ids)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the models' ``vocab_size``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string.

        Args:
            token: the token as the vocabulary writes it (``"Ġthe"``, ``"[CLS]"``), not text to encode.

        Returns:
            Its id, or None when the vocabulary has no such token.
        """
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of an id (the inverse of ``token_to_id``).

        Args:
            token_id: an id.

        Returns:
            The token as the vocabulary writes it, or None for an id outside the vocabulary.
        """
        return self.backend.id_to_token(token_id)

    def set_template(self, family: str) -> None:
        """Install the post-processing template of a model family (see ``tokenization.templates``).

        Args:
            family: ``"encoder"`` (``[CLS] ... [SEP]``), ``"decoder"`` (BOS ... EOS), ``"seq2seq"`` or ``"none"``.

        Raises:
            ValueError: an unknown family or a role it needs is unset.
        """
        tokens = {role: (tok, self._role_id(role)) if tok is not None else None for role, tok in self._roles.items()}
        self.backend.post_processor = template_processor(family, tokens)

    # ------------------------------------------------------------------ encoding
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text (special tokens placed by the post-processing template).

        Args:
            text: the text.
            add_special_tokens: apply the post-processing template.

        Returns:
            The ids.

        Raises:
            ValueError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(
        self,
        texts: str | Sequence[str],
        text_pairs: str | Sequence[str] | None = None,
        *,
        padding: bool | str = True,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = "pt",
        add_special_tokens: bool = True,
        padding_side: str = "right",
        return_word_ids: bool = False,
    ) -> dict[str, Any]:
        """Encode a batch for the models.

        Args:
            texts: one text or a list of texts.
            text_pairs: optional second segments (same count); they get ``token_type_ids`` 1.
            padding: True/"longest" pads to the longest row, "max_length" to ``max_length``, False not at all.
            truncation: cut rows (content first, special tokens kept) to ``max_length``.
            max_length: the length for truncation and "max_length" padding.
            return_tensors: "pt" for torch tensors, None for Python lists.
            add_special_tokens: apply the post-processing template.
            padding_side: "right" or "left" (left suits batched generation).
            return_word_ids: add ``word_ids``: the index of the word each token came from, -1 for special
                and padding tokens (what whole-word masking needs).

        Returns:
            ``input_ids`` ``(B, L)`` long, ``attention_mask`` ``(B, L)`` bool (True = real token), and
            ``token_type_ids`` ``(B, L)`` long when pairs are given.

        Raises:
            ValueError: bad argument values (named), padding without a pad token, truncation or
                "max_length" padding without ``max_length``, or unequal rows for tensors without padding.

        Shapes: ``B = len(texts)``; ``L`` the longest row, or ``max_length`` with "max_length" padding.
        """
        batch, pairs = as_text_batch(texts, "texts"), None
        if text_pairs is not None:
            pairs = as_text_batch(text_pairs, "text_pairs")
            if len(pairs) != len(batch):
                raise ValueError(f"got {len(batch)} texts but {len(pairs)} text_pairs; they must match")
        check_batch_options(padding=padding, truncation=truncation, max_length=max_length,
                            return_tensors=return_tensors, padding_side=padding_side, pad_token_id=self.pad_token_id)

        inputs = batch if pairs is None else list(zip(batch, pairs, strict=True))
        with backend_settings(self.backend, padding=padding, truncation=truncation, max_length=max_length,
                              side=padding_side, pad_id=self.pad_token_id, pad_token=self._roles["pad"]):
            encodings = self.backend.encode_batch(inputs, add_special_tokens=add_special_tokens)

        out: dict[str, Any] = {
            "input_ids": [e.ids for e in encodings],
            "attention_mask": [[bool(m) for m in e.attention_mask] for e in encodings],
        }
        if pairs is not None:
            out["token_type_ids"] = [e.type_ids for e in encodings]
        if return_word_ids:
            out["word_ids"] = [
                [-1 if w is None or s else w for w, s in zip(e.word_ids, e.special_tokens_mask, strict=True)]
                for e in encodings
            ]
        if return_tensors is None:
            return out
        lengths = {len(row) for row in out["input_ids"]}
        if len(lengths) > 1:
            raise ValueError(f"rows have different lengths {sorted(lengths)}; use padding=True for tensors")
        width = lengths.pop() if lengths else 0
        return {
            key: torch.tensor(value, dtype=torch.bool if key == "attention_mask" else torch.long).reshape(-1, width)
            for key, value in out.items()
        }

    # ------------------------------------------------------------------ decoding
    def decode(self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = True) -> str:
        """Text of one sequence of ids.

        Args:
            ids: a list of ids or a 1-D tensor.
            skip_special_tokens: leave the special tokens out of the text.

        Returns:
            The text.

        Shapes: ids ``(L,)``.

        Raises:
            ValueError: ``ids`` is not 1-D, or holds an id outside ``[0, vocab_size)``.
        """
        return self.backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Iterable[Sequence[int]] | Tensor, skip_special_tokens: bool = True) -> list[str]:
        """Texts of a batch of id sequences.

        Args:
            batch: a ``(B, L)`` tensor or a list of id lists.
            skip_special_tokens: leave the special tokens out of the texts.

        Returns:
            One text per row.

        Raises:
            ValueError: a tensor that is not 2-D, or an id outside ``[0, vocab_size)``.

        Shapes: batch ``(B, L)``.
        """
        if isinstance(batch, Tensor) and batch.dim() != 2:
            raise ValueError(f"batch must be a (B, L) tensor, got shape {tuple(batch.shape)}")
        return self.backend.decode_batch([self._check_ids(ids) for ids in batch],
                                         skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Sequence[int] | Tensor) -> list[int]:
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"ids must be a 1-D tensor, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        ids = list(ids)
        # Counting the vocabulary costs O(vocabulary) in tokenizers (2 ms for 49k added tokens), and a stream decodes
        # once per token: the count is kept, and taken again only when an id is not below it (a vocabulary only
        # grows, so ids below an earlier count are valid).
        size = self._known_size
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size]
        if bad:
            size = self._known_size = self.vocab_size
            bad = [i for i in bad if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size]
        if bad:
            raise ValueError(f"ids must be integers in [0, vocab_size={size}), got {bad[0]!r}")
        return ids

    def __repr__(self) -> str:
        model = type(self.backend.model).__name__
        return f"Tokenizer({model}, vocab_size={self.vocab_size}, special_tokens={self._roles})"
