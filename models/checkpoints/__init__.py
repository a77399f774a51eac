"""Checkpoint folders and the Hub: everything that reads or writes a model's files.

- ``files`` — the folder's file names, ``config.json`` and weights (safetensors; ``pytorch_model.bin`` read with
  ``weights_only=True``), tokenizer files.
- ``architectures`` — the ``"architecture"`` name in ``config.json`` -> the model class (``@register_architecture``).
- ``persistence`` — ``PersistenceMixin``: ``save_pretrained``, ``from_pretrained``, ``push_to_hub``, model cards.
- ``adapter_files`` — LoRA adapters in peft's file layout: save, load, push.
"""
