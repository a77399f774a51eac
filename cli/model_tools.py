"""``zoo merge`` (a LoRA adapter into its base) and ``zoo convert`` (to a transformers folder or a GGUF file).

    zoo merge ./base runs/sft/adapter --out ./merged
    zoo convert ./merged --to transformers --out ./merged-hf
    zoo convert ./merged --to gguf --out ./merged.gguf --dtype Q8_0
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

FORMATS = ("transformers", "gguf", "zoo")


def add_commands(sub: Any) -> dict[str, Callable[[argparse.Namespace], None]]:
    """Add ``merge`` and ``convert`` to the subparsers ``sub`` of the ``zoo`` command.

    Args:
        sub: what ``ArgumentParser.add_subparsers`` returned.

    Returns:
        ``{"merge": handler, "convert": handler}``.
    """
    m = sub.add_parser("merge", help="merge a LoRA adapter into its base model", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("model", help="the base: a checkpoint folder, Hub repo id or .gguf file")
    m.add_argument("adapter", help="the adapter folder (peft layout, as zoo finetune --lora writes)")
    m.add_argument("--out", required=True, help="the merged checkpoint's folder")
    c = sub.add_parser("convert", help="write a model as a transformers folder, a GGUF file or a zoo checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("model", help="a checkpoint folder, Hub repo id or .gguf file")
    c.add_argument("--to", choices=FORMATS, required=True)
    c.add_argument("--out", required=True, help="a folder (transformers, zoo) or a .gguf file")
    c.add_argument("--dtype", default="F32", help="gguf: the weight type (F32, F16, BF16, Q8_0, ...)")
    c.add_argument("--dequantize", action="store_true", help="load a quantized checkpoint's weights as float32")
    return {"merge": run_merge, "convert": run_convert}


def run_merge(args: argparse.Namespace) -> Path:
    """Run ``zoo merge``.

    Args:
        args: the parsed ``zoo merge`` options.

    Returns:
        The folder written.

    Raises:
        SystemExit: the adapter cannot be loaded onto or merged into the model.
    """
    import models

    model = models.from_pretrained(args.model)
    try:
        model.load_adapter(args.adapter)
        model.merge_and_unload()
    except ValueError as err:
        raise SystemExit(f"zoo merge: {err}") from None
    target = model.save_pretrained(args.out)
    print(f"merged {args.adapter} into {args.model}: {target}")
    return target


def run_convert(args: argparse.Namespace) -> Path:
    """Run ``zoo convert``.

    Args:
        args: the parsed ``zoo convert`` options.

    Returns:
        The folder or file written.

    Raises:
        SystemExit: the model cannot be written in the format asked for.
    """
    import models
    from models.convert.export import save_transformers

    options = {"dequantize": True} if args.dequantize else {}
    model = models.from_pretrained(args.model, **options)
    tok = getattr(model, "tokenizer", None)
    try:
        if args.to == "gguf":
            target = Path(model.save_gguf(args.out, args.dtype))
        elif args.to == "transformers":
            target = save_transformers(model, args.out, tokenizer=tok)  # one atomic save, tokenizer included
        else:
            target = model.save_pretrained(args.out)
    except ValueError as err:
        raise SystemExit(f"zoo convert: {err}") from None
    print(f"wrote {target}")
    return target
