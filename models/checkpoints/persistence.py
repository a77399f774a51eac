"""Persistence: safetensors checkpoints and the Hugging Face Hub (mixed into the model classes).

``model.save_pretrained(dir)`` writes ``config.json`` (architecture, format version, config),
``model.safetensors`` (tied weights stored once), ``tokenizer.json`` when there is a tokenizer and a
``README.md`` model card, atomically. ``Model.from_pretrained(path_or_repo_id)`` reads a folder or a Hub repo
at any revision; ``model.push_to_hub(repo_id)`` uploads the same folder in one commit. All Hub traffic goes
through ``huggingface_hub``.

Quantized models (``model.quantize("int8")``, a GGUF file loaded packed; see ``blocks.quantized``) are saved as
they are: the safetensors file holds each quantized layer's packed tensors (its scheme's ``state_names``, e.g.
``weight_int8`` and ``scale`` for int8, ``d`` and ``qs`` for q8_0) and ``bias``, and ``config.json`` gets a
top-level entry beside ``dtype``::

    "quantization": {"scheme": "int8", "modules": ["layers.0.self_attn.q_proj", ..., "lm_head"]}

``scheme`` is a name of ``blocks.names("quantization")`` (its registered layer defines the packed tensors and how
they unpack); ``modules`` lists the quantized layers, so a partly quantized model loads too; a scheme with options
adds ``"options": {"group_size": 64, ...}``. A model whose layers mix schemes (a GGUF file's Q4_K and Q6_K tensors)
records each layer's scheme instead: ``{"modules": {"embed_tokens": "q6_k", "layers.0.self_attn.q_proj": "q4_k",
...}, "options": {scheme: {...}}}``; an ``nn.Embedding`` named there is a packed table (``QuantizedEmbedding``).
Loading builds the model from ``config``, quantizes exactly those layers, then loads the tensors strictly. The entry
is absent for an unquantized model, so its ``config.json`` is unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from huggingface_hub import ModelCardData

from blocks.adapters import check_exportable
from blocks.quantized import QuantizedLinear, quantization_options, quantized_modules

from . import files
from .atomic import write_folder
from .files import QUANTIZATION_KEY
from .hub import check_push_arguments, push_folder
from .loading import load_pretrained
from .options import LoadOptions

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

M = TypeVar("M", bound="PersistenceMixin")


class PersistenceMixin:
    """``save_pretrained``, ``from_pretrained`` and ``push_to_hub``. A model class that saves also registers its
    name with ``@register_architecture`` (``models.checkpoints.architectures``) so ``models.from_pretrained`` finds it.

    ``model.tokenizer`` (default ``None``) is set by ``from_pretrained`` when the checkpoint holds a
    tokenizer, and is saved and pushed along with the weights.

    ``model.transformers_model_type`` (default ``None``) is the ``transformers`` family (``model_type``) a model
    converted from a ``transformers`` checkpoint came from; ``save_pretrained`` records it in ``config.json`` and
    ``models.convert.to_transformers`` writes the model back as that family (its class and its names) where it can.
    """

    tokenizer: Any = None
    transformers_model_type: str | None = None

    # ------------------------------------------------------------------ local folders
    def save_pretrained(self, save_directory: str | os.PathLike[str], tokenizer: Any = None) -> Path:
        """Write the checkpoint folder ``save_directory`` atomically.

        Files: ``config.json``, ``model.safetensors`` (parameters in their current dtype; tied weights once),
        ``tokenizer.json`` (from ``tokenizer``, else ``self.tokenizer``, if any) and ``README.md``. Everything
        is written and fsynced in a hidden folder beside it, then committed with one rename and switched in
        (see ``models.checkpoints.atomic``): a save killed at any instant, even by SIGKILL, leaves the complete
        old or the complete new checkpoint, and the next save or load cleans up what it left. Other files already
        in the folder are left alone.

        Args:
            save_directory: the folder (created with its parents if needed).
            tokenizer: anything with ``save(path)`` writing a ``tokenizers`` JSON file (a ``tokenizers.Tokenizer``
                or ``tokenization.Tokenizer``).

        Returns:
            The folder's path.

        A quantized model is saved quantized (its packed tensors) and ``config.json`` records the schemes
        and the quantized layers (see the module docstring); ``from_pretrained`` rebuilds it quantized.

        Raises:
            TypeError: ``save_directory`` is not a path, or ``tokenizer`` has no ``save`` method.
            ValueError: the model carries adapters (``merge_and_unload()`` first, or ``save_adapter()``), or mixes
                quantization schemes.
            NotADirectoryError: ``save_directory`` exists and is a file.
        """
        if not isinstance(save_directory, (str, os.PathLike)):
            raise TypeError(f"save_directory must be a folder path, got {type(save_directory).__name__}")
        check_exportable(self, "save_pretrained", allow_merged=False)
        _quantization_entry(self)  # refuse a model mixing quantization schemes before anything is written
        tokenizer = self._tokenizer_to_save(tokenizer)
        write_folder(
            Path(save_directory),
            lambda folder: self._write_checkpoint(folder, tokenizer, card_reference=str(save_directory)),
        )
        return Path(save_directory).expanduser()

    @classmethod
    def from_pretrained(cls: type[M], path_or_repo_id: str | os.PathLike[str], **options: Unpack[LoadOptions]) -> M:
        """Load a checkpoint of this class from a local folder, a ``.gguf`` file or a Hub repo (any revision).

        The weights must fit the config exactly: missing, unexpected or mis-shaped tensors are an error. A quantized
        checkpoint (``config.json`` has a ``quantization`` entry) gives a quantized model with the saved packed tensors.
        Checkpoints written by ``transformers`` (and GGUF files) are converted when ``models.convert`` supports
        them. The keyword arguments (``revision``, ``device``, ``dtype``, ``attention_backend``, ``token``,
        ``endpoint``) are those of ``models.auto.LoadOptions``.

        Args:
            path_or_repo_id: a local folder, a ``.gguf`` file, or a Hub repository id (``"org/name"``).
            **options: the ``LoadOptions``.

        Returns:
            The model in eval mode; ``model.tokenizer`` holds the checkpoint's tokenizer if it has one.

        Raises:
            ValueError: a checkpoint of another architecture (both are named), weights that do not fit (quantized
                weights without a ``quantization`` entry or the reverse: the scheme is named), a malformed
                ``quantization`` entry, corrupted files, a pickle that is not plain tensors, or bad option values.
            TypeError: an unknown keyword argument.
            FileNotFoundError: a local folder without ``config.json`` or weights.
            huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: from
                the Hub, with repo and revision in the message; HfHubHTTPError when the Hub keeps failing.
        """
        return load_pretrained(path_or_repo_id, cls, **options)  # type: ignore[return-value]

    # ------------------------------------------------------------------ the Hub
    def push_to_hub(
        self,
        repo_id: str,
        private: bool = False,
        commit_message: str | None = None,
        revision: str | None = None,
        tokenizer: Any = None,
        *,
        token: str | bool | None = None,
        endpoint: str | None = None,
    ) -> CommitInfo:
        """Upload the checkpoint folder to a Hub model repo in one commit, creating repo and branch if needed.

        Args:
            repo_id: ``"namespace/name"`` (or ``"name"`` in the token owner's namespace).
            private: create the repo private (ignored when it exists).
            commit_message: default ``"Upload <Architecture> with transformer-zoo"``.
            revision: branch to commit to (default ``"main"``); created from ``main`` if missing.
            tokenizer: also upload this tokenizer (default: ``self.tokenizer`` if set).
            token: Hub token (default: the usual ``huggingface_hub`` places); never printed.
            endpoint: Hub URL (default: ``HF_ENDPOINT`` or huggingface.co).

        Returns:
            ``huggingface_hub.CommitInfo``: ``.commit_url`` and ``.oid`` (the commit sha, usable as ``revision``).
            When nothing changed since the last push, no commit is made and the current head is returned.

        Raises:
            ValueError: an invalid ``repo_id`` or ``revision``; a model carrying adapters or mixing quantization
                schemes.
            TypeError: ``private`` is not a bool, or ``tokenizer`` has no ``save`` method.
            huggingface_hub.errors.HfHubHTTPError: the Hub refused (e.g. no write access).
        """
        check_push_arguments(repo_id, private, revision)
        check_exportable(self, "push_to_hub", allow_merged=False)
        _quantization_entry(self)
        tokenizer = self._tokenizer_to_save(tokenizer)
        return push_folder(
            repo_id, lambda folder: self._write_checkpoint(folder, tokenizer, card_reference=repo_id),
            commit_message=commit_message or f"Upload {type(self).__name__} with transformer-zoo", private=private,
            revision=revision, token=token, endpoint=endpoint,
        )

    # ------------------------------------------------------------------ the model card
    def model_card(self, reference: str | None = None, tokenizer: Any = None) -> str:
        """The ``README.md`` model card: YAML metadata, architecture, parameter count, config table, usage.

        Args:
            reference: what the usage snippet passes to ``from_pretrained`` (a repo id or a folder).
            tokenizer: the tokenizer saved along (default: ``self.tokenizer``); the card says whether there is one.

        Returns:
            The card's Markdown.
        """
        name = type(self).__name__
        config = self.config.to_dict()
        dtype = _dtype_name(self)
        data = ModelCardData(library_name=files.LIBRARY_NAME, tags=[files.LIBRARY_NAME, name, "safetensors"])
        summary = (type(self).__doc__ or "").strip().split("\n\n")[0]
        summary = " ".join(line.strip() for line in summary.splitlines())
        rows = "\n".join(f"| `{key}` | `{value!r}` |" for key, value in config.items())
        reference = reference or "path/to/checkpoint"
        quantization = _quantization_entry(self)
        # Quantized weights are buffers, not parameters; they are still the model's weights.
        n_params = sum(p.numel() for p in self.parameters()) + sum(
            m.in_features * m.out_features for m in self.modules() if isinstance(m, QuantizedLinear)
        )
        if quantization is not None:
            layers = quantized_modules(self)
            schemes = ", ".join(f"`{s}`" for s in sorted(set(layers.values())))
            dtype += f"; {len(layers)} layer(s) quantized as {schemes} (weight-only, see `config.json`)"
        has_tokenizer = (tokenizer if tokenizer is not None else self.tokenizer) is not None
        tokenizer_line = "included (`tokenizer.json`)" if has_tokenizer else "not included"
        # Import from the package when it re-exports the class (``from models import DecoderLM``).
        package = type(self).__module__.split(".")[0]
        exported = getattr(sys.modules.get(package), name, None) is type(self)
        module = package if exported else type(self).__module__
        body = f"""
# {name}

{summary}

A `{name}` checkpoint saved with transformer-zoo.

- Parameters: {n_params:,} (tied weights counted once)
- Weights: `{files.WEIGHTS_NAME}`, {dtype}
- Tokenizer: {tokenizer_line}

## Usage

```python
from {module} import {name}

model = {name}.from_pretrained({json.dumps(reference)})
```

## Configuration

| field | value |
|---|---|
{rows}
"""
        return f"---\n{data.to_yaml()}\n---\n{body}"

    # ------------------------------------------------------------------ helpers
    def _tokenizer_to_save(self, tokenizer: Any) -> Any:
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        if tokenizer is not None and not callable(getattr(tokenizer, "save", None)):
            raise TypeError(
                f"tokenizer must have a save(path) method writing tokenizer.json (a tokenizers.Tokenizer or "
                f"tokenization.Tokenizer), got {type(tokenizer).__name__}"
            )
        return tokenizer

    def _write_checkpoint(self, folder: Path, tokenizer: Any, card_reference: str) -> None:
        name = type(self).__name__
        files.save_weights(files.unique_state(self), folder / files.WEIGHTS_NAME)
        if tokenizer is not None:
            tokenizer.save(str(folder / files.TOKENIZER_NAME))
        (folder / files.CARD_NAME).write_text(self.model_card(card_reference, tokenizer), encoding="utf-8")
        config = {
            "architecture": name,
            "format_version": files.FORMAT_VERSION,
            "config": self.config.to_dict(),
            "library": files.LIBRARY_NAME,
            "library_version": files.library_version(),
            "dtype": _dtype_name(self),
        }
        if self.transformers_model_type is not None:  # only then: other checkpoints' config.json stays as it was
            config[files.SOURCE_FAMILY_KEY] = self.transformers_model_type
        quantization = _quantization_entry(self)
        if quantization is not None:  # only then: an unquantized model's config.json stays byte-identical
            config[QUANTIZATION_KEY] = quantization
        files.write_json(config, folder / files.CONFIG_NAME)


def _quantization_entry(model: Any) -> dict[str, Any] | None:
    """``config.json``'s ``quantization`` entry for ``model`` (see the module docstring), ``None`` if unquantized.

    Raises:
        ValueError: layers of one scheme quantized with different options.
    """
    layers = quantized_modules(model)
    if not layers:
        return None
    options = quantization_options(model)
    schemes = sorted(set(layers.values()))
    if len(schemes) > 1:
        entry: dict[str, Any] = {"modules": layers}
        if options:
            entry["options"] = options
        return entry
    entry = {"scheme": schemes[0], "modules": list(layers)}
    if options:
        entry["options"] = options[schemes[0]]
    return entry


def _dtype_name(model: Any) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return dtypes[0] if len(dtypes) == 1 else "mixed (" + ", ".join(dtypes) + ")"
