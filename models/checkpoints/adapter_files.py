"""LoRA adapters as ``peft`` files in a folder or a Hub repo: ``AdapterFilesMixin`` gives every model class
``save_adapter``, ``load_adapter`` and ``push_adapter_to_hub``.

The files are ``adapter_config.json`` and ``adapter_model.safetensors`` (``adapter_model.bin`` is read too, with
``weights_only=True``) in the layout of ``models.checkpoints.peft_lora``; folders are written atomically
(``models.checkpoints.atomic``), found with the same ``locate`` as model checkpoints and pushed with the same
``push_folder``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import ModelCardData
from torch import Tensor, nn

from blocks.adapters import LoRA

from ..core.finite import check_finite
from .atomic import reading, write_folder
from .files import CARD_NAME, LIBRARY_NAME, read_json, read_pickle, read_safetensors, save_weights, write_json
from .hub import check_push_arguments, naming_the_repo, push_folder
from .locate import Location, locate
from .peft_lora import ADAPTER_CONFIG_NAME, peft_files, zoo_adapters
from .peft_names import name_map
from .peft_saved import load_saved_head, split_saved_head, with_saved_head

if TYPE_CHECKING:
    from huggingface_hub import CommitInfo

ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_PICKLE_NAME = "adapter_model.bin"


def _adapter_weights(location: Location) -> Path:
    """The located adapter's weights: ``adapter_model.safetensors``, else ``adapter_model.bin`` (downloaded from the
    located commit for a Hub adapter).

    Raises:
        FileNotFoundError: a local folder with neither file.
        huggingface_hub.errors.EntryNotFoundError: a Hub repo with neither (repo and revision named).
    """
    folder = location.folder
    if folder is None:
        with naming_the_repo(location.repo_id, location.revision):
            return location.fetch_optional(ADAPTER_WEIGHTS_NAME) or location.fetch(ADAPTER_PICKLE_NAME)
    for weights in (ADAPTER_WEIGHTS_NAME, ADAPTER_PICKLE_NAME):
        if (folder / weights).is_file():
            return folder / weights
    present = sorted(p.name for p in folder.iterdir())
    raise FileNotFoundError(f"{folder} has no {ADAPTER_WEIGHTS_NAME} or {ADAPTER_PICKLE_NAME}; it holds {present}")


def _write(folder: Path, config: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module, reference: str) -> None:
    save_weights(tensors, folder / ADAPTER_WEIGHTS_NAME)
    write_json(config, folder / ADAPTER_CONFIG_NAME)
    (folder / CARD_NAME).write_text(_card(config, tensors, model, reference), encoding="utf-8")


def _card(config: dict[str, Any], tensors: dict[str, Tensor], model: nn.Module, reference: str) -> str:
    """A short ``README.md``: peft metadata, what the adapter adapts, and how to load it with either library."""
    base = config["base_model_name_or_path"]
    data = ModelCardData(library_name="peft", base_model=base, tags=[LIBRARY_NAME, "lora", "peft"])
    n_params = sum(t.numel() for t in tensors.values())
    return f"""---
{data.to_yaml()}
---

# LoRA adapter

A LoRA adapter (rank {config["r"]}, alpha {config["lora_alpha"]}) for a `{type(model).__name__}`, saved with
transformer-zoo in the `peft` layout; {n_params:,} parameters on the modules `{config["target_modules"]}`.

```python
model.load_adapter({json.dumps(reference)})                     # a transformer-zoo model
peft.PeftModel.from_pretrained(transformers_model, {json.dumps(reference)})  # or peft on transformers
```
"""


def read_adapter(
    model: nn.Module, path_or_repo_id: str | os.PathLike[str], *, revision: str | None = None,
    model_type: str | None = None, token: str | bool | None = None, endpoint: str | None = None,
) -> tuple[dict[str, LoRA], dict[str, Tensor]]:
    """Read a ``peft`` LoRA adapter for ``model`` without changing the model.

    Args:
        model: the zoo model the adapter is for.
        path_or_repo_id: a folder with the adapter files, or a Hub repo id.
        revision: Hub branch, tag or commit.
        model_type: read the module names as this ``transformers`` family's.
        token: passed to ``huggingface_hub``.
        endpoint: passed to ``huggingface_hub``.

    Returns:
        The zoo LoRA blocks by layer name, and the task head's tensors saved with it (``modules_to_save``; empty
        when none).

    Raises:
        ValueError: as ``AdapterFilesMixin.load_adapter``.

    Shapes: each LoRA's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)``; the head's tensors as the head's.
    """
    if model_type is not None:
        name_map(model, model_type)  # a family that cannot represent the model fails before any download
    location = locate(
        path_or_repo_id, revision=revision, token=token, endpoint=endpoint, config_name=ADAPTER_CONFIG_NAME,
        kind="adapter",
    )
    weights_path = _adapter_weights(location)
    with reading(location.folder):  # a local folder is held still while a save may be replacing its files
        config = read_json(location.config)
        if weights_path.name == ADAPTER_PICKLE_NAME:
            tensors = read_pickle(weights_path)
        else:
            tensors = read_safetensors(weights_path)
    config, tensors, saved_head = split_saved_head(model, config, tensors, location.source, model_type)
    return zoo_adapters(model, config, tensors, location.source, model_type), saved_head


class AdapterFilesMixin:
    """``save_adapter``, ``load_adapter`` and ``push_adapter_to_hub``, mixed into every model class beside
    ``ZooModel`` (whose ``models.core.adapters.AdapterMixin`` adds, switches and merges adapters)."""

    def save_adapter(
        self,
        save_directory: str | os.PathLike[str],
        name: str | None = None,
        *,
        base_model: str | None = None,
        model_type: str | None = None,
    ) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` in the ``peft`` layout, atomically.

        Module names are those of the ``transformers`` model the zoo model exports to (``models.convert``), so
        ``peft.PeftModel.from_pretrained(transformers_model, folder)`` reproduces this model's logits; a LoRA on
        layers that ``transformers`` fuses (GPT-2's ``c_attn`` holds q, k and v) is written as one LoRA on the
        fused module. A model no ``transformers`` family represents keeps its zoo module names. A task head with
        trainable parameters (trained beside the LoRA) is saved whole as ``modules_to_save``
        (``models.checkpoints.peft_saved``).

        Args:
            save_directory: the folder (created if needed; other files in it are left alone).
            name: which adapter (default: the active one).
            base_model: recorded as ``base_model_name_or_path`` (e.g. the Hub repo of the base model).
            model_type: the ``transformers`` family whose module names to write (default: the first that
                represents the model, as ``models.convert.to_transformers`` picks; a BERT-shaped encoder that came
                from a RoBERTa checkpoint needs ``model_type="roberta"``).

        Returns:
            The folder's path.

        Raises:
            ValueError: no such adapter, an adapter kind without a ``peft`` layout, a ``model_type`` that cannot
                represent the model, adapted layers that the ``transformers`` model has no module for, or an adapter
                tensor holding NaN or inf (named). Nothing is written then.
        """
        if not isinstance(save_directory, (str, os.PathLike)):
            raise TypeError(f"save_directory must be a folder path, got {type(save_directory).__name__}")
        config, tensors = peft_files(self, self.adapter_to_save(name), base_model, model_type)
        config, tensors = with_saved_head(self, config, tensors, model_type)
        check_finite(tensors, "save_adapter")
        target = Path(save_directory).expanduser()
        write_folder(target, lambda folder: _write(folder, config, tensors, self, reference=str(save_directory)),
                     what="an adapter")
        return target

    def load_adapter(
        self,
        path_or_repo_id: str | os.PathLike[str],
        name: str = "default",
        *,
        revision: str | None = None,
        model_type: str | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
    ) -> list[str]:
        """Load a LoRA adapter that ``peft`` (or ``save_adapter``) saved, from a folder or a Hub repo, and make it
        the active one. The model is frozen as by ``add_adapter``.

        Module names are mapped from the ``transformers`` model the zoo model exports to; an adapter saved on a
        base model (``BertModel``) or a task model (``BertForMaskedLM``) both load. A LoRA on a fused
        ``transformers`` module becomes LoRAs on the zoo's layers with one shared ``A`` (tied, so training goes on
        as in ``peft``) and the matching slices of ``B``; when ``B`` is block-diagonal over the parts (as
        ``save_adapter`` writes separate LoRAs), each part gets back its own smaller LoRA. A task head saved with the
        adapter (``modules_to_save``) replaces the weights of ``model.head``, which is then trainable.

        Args:
            path_or_repo_id: a folder with ``adapter_config.json`` and ``adapter_model.safetensors`` (or
                ``adapter_model.bin``, read with ``weights_only=True``), or a Hub repo id.
            name: the name to give the adapter on this model.
            revision: Hub branch, tag or commit (default ``"main"``); not for local folders.
            model_type: read the module names as this ``transformers`` family's (default: the first family that
                represents the model and has every module the adapter names).
            token: passed to ``huggingface_hub``.
            endpoint: passed to ``huggingface_hub``.

        Returns:
            The names of the adapted zoo layers.

        Raises:
            ValueError: a used or invalid name; a config that is not LoRA or uses what the zoo does not implement
                (DoRA, trained biases, ``modules_to_save`` other than the task head, embedding LoRA,
                ``target_modules="all-linear"``); a config
                field of the wrong type or range or an invalid pattern (the field is named); tensors that are not 2-d,
                floating point and finite, or whose rank is not the config's; modules this model does not have (an
                adapter for another architecture) or tensors of other shapes; a fused module whose LoRA cannot be
                split. Nothing is changed then. Tensors of modules that ``target_modules``, ``exclude_modules`` and
                ``layers_to_transform`` do not select are ignored with a warning, as ``peft`` ignores them.
            FileNotFoundError: a folder without the adapter files.
            huggingface_hub.errors.RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError: from the Hub.
        """
        self.check_new_adapter_name(name)
        adapters, saved_head = read_adapter(self, path_or_repo_id, revision=revision, model_type=model_type,
                                            token=token, endpoint=endpoint)
        self.install_adapter(name, adapters)
        load_saved_head(self, saved_head)
        return sorted(adapters)

    def push_adapter_to_hub(
        self,
        repo_id: str,
        name: str | None = None,
        *,
        private: bool = False,
        commit_message: str | None = None,
        revision: str | None = None,
        base_model: str | None = None,
        model_type: str | None = None,
        token: str | bool | None = None,
        endpoint: str | None = None,
    ) -> CommitInfo:
        """Upload the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, ``README.md``) to a
        Hub model repo in one commit, creating the repo and the branch if needed.

        Args:
            repo_id: ``"namespace/name"``.
            name: which adapter (default: the active one).
            private: create the repo private (ignored when it exists).
            commit_message: default ``"Upload LoRA adapter with transformer-zoo"``.
            revision: branch to commit to (default ``"main"``).
            base_model: recorded as ``base_model_name_or_path`` and in the card.
            model_type: the ``transformers`` family whose module names to write (see ``save_adapter``).
            token: passed to ``huggingface_hub``.
            endpoint: passed to ``huggingface_hub``.

        Returns:
            ``huggingface_hub.CommitInfo`` (``.oid`` is the commit sha).

        Raises:
            ValueError: as ``save_adapter`` (before any request), or an invalid ``repo_id``/``revision``.
            huggingface_hub.errors.HfHubHTTPError: the Hub refused.
        """
        check_push_arguments(repo_id, private, revision)
        config, tensors = peft_files(self, self.adapter_to_save(name), base_model, model_type)  # before any request
        config, tensors = with_saved_head(self, config, tensors, model_type)
        return push_folder(
            repo_id, lambda folder: _write(folder, config, tensors, self, reference=repo_id),
            commit_message=commit_message or "Upload LoRA adapter with transformer-zoo", private=private,
            revision=revision, token=token, endpoint=endpoint,
        )
