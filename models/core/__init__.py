"""The models core: what every model class is made of, below generation, checkpoints and the classes themselves.

- ``config`` — ``ConfigBase``, ``TransformerConfig`` and their validation.
- ``outputs`` — ``ModelOutput``, ``Seq2SeqOutput``.
- ``base`` — ``ZooModel``: presets, backend switching, input checks.
- ``presets`` — ``PresetTable``: preset names in one convention, any spelling found, "did you mean" for a typo.
- ``stack`` — building and running a stack of layers from a config (layers, norms, positions, caches, LM loss).
- ``adapters`` — ``AdapterMixin``: adding, switching and merging LoRA adapters (module surgery only).
- ``quantize`` — ``QuantizeMixin``: ``quantize()`` / ``dequantize()``.
"""
