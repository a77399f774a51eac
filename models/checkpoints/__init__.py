"""Checkpoint folders and the Hub: everything that reads or writes a model's files. Lowest first:

- ``files`` — the folder's file names, ``config.json`` and weights (safetensors; ``pytorch_model.bin`` read with
  ``weights_only=True``), tokenizer files.
- ``options`` — ``LoadOptions``, the keyword arguments of every ``from_pretrained``, checked and parsed.
- ``architectures`` — the ``"architecture"`` name in ``config.json`` -> the model class (``@register_architecture``).
- ``atomic`` — folders written atomically even against SIGKILL (models, adapters and trainer checkpoints), their
  recovery, and reading under a lock.
- ``hub`` — Hub downloads with retries, and the one push of a folder in one commit.
- ``locate`` — find a checkpoint (or an adapter) in a folder or one Hub commit, and its files.
- ``loading`` — ``load_pretrained`` and ``load_state_into``: build the model and load the weights strictly
  (``models.gguf`` files and ``transformers`` checkpoints converted on the fly).
- ``persistence`` — ``PersistenceMixin``: ``save_pretrained``, ``from_pretrained``, ``push_to_hub``, model cards.
- ``peft_names``, ``peft_lora``, ``adapter_files`` — LoRA adapters in peft's layout: module names read off the
  exporters, zoo LoRA <-> peft tensors, and ``AdapterFilesMixin``'s save, load and push.
"""
