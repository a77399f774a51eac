"""``models.from_pretrained``: load any saved model, the class chosen from its ``config.json``.

Every model class registers itself under its class name (``@register_architecture``, in
``models.checkpoints.architectures``), so ``from_pretrained(path_or_repo_id)`` can rebuild any saved model without
being told its class. The loading itself (``transformers`` checkpoints and GGUF files converted on the fly, quantized
checkpoints rebuilt quantized) is ``models.checkpoints.loading``; the keyword arguments are ``LoadOptions``
(``models.checkpoints.options``), re-exported here with the architecture registry.
"""

from __future__ import annotations

import os
from typing import Unpack

from torch import nn

from .checkpoints.architectures import architectures, get_architecture, register_architecture
from .checkpoints.loading import load_pretrained, load_state_into
from .checkpoints.options import LoadOptions

__all__ = [
    "LoadOptions",
    "architectures",
    "from_pretrained",
    "get_architecture",
    "load_pretrained",
    "load_state_into",
    "register_architecture",
]


def from_pretrained(path_or_repo_id: str | os.PathLike[str], **options: Unpack[LoadOptions]) -> nn.Module:
    """Load any saved model, choosing its class from ``config.json``.

    Same arguments and behaviour as ``Model.from_pretrained`` (see ``models.checkpoints.loading.load_pretrained``
    and ``LoadOptions``), without naming the class.

    Args:
        path_or_repo_id: a local folder, a ``.gguf`` file, or a Hub repository id (``"org/name"``).
        **options: the ``LoadOptions`` (``revision``, ``device``, ``dtype``, ``attention_backend``, ``token``,
            ``endpoint``, ``gguf_file``, ``head``, ``head_options``, ``num_labels``, ``id2label``, ``dequantize``).

    Returns:
        The model (in eval mode), with ``model.tokenizer`` set when the checkpoint holds a tokenizer.
    """
    return load_pretrained(path_or_repo_id, None, **options)
