"""Plot the attention maps of a trained model as a PNG: one panel per layer and head.

Without ``--model`` a Seq2SeqTransformer is trained on the reverse task for ``--steps`` steps (see
``examples/translate.py``) and its cross-attention on a held-out input is drawn: each output symbol looks at
its mirror position in the source, an anti-diagonal. With ``--model`` any checkpoint folder that holds a
tokenizer (from ``examples/generate.py``, ``examples/mlm.py`` or the Hub) is loaded and its self-attention (or
an encoder-decoder's cross-attention) on ``--text`` is drawn. Needs matplotlib (the ``plot`` extra).

    python examples/plot_attention.py                                      # reverse task, runs/attention.png
    python examples/plot_attention.py --model runs/generate --text "Return the number of items."
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from models import DecoderLM, EncoderLM, Seq2SeqTransformer, from_pretrained
from training import held_out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint folder or Hub repo id (default: train on reverse)")
    parser.add_argument("--text", default="Return the number of items in the container.",
                        help="input text for --model")
    parser.add_argument("--out", default="runs/attention.png", help="the PNG to write")
    parser.add_argument("--steps", type=int, default=800, help="training steps of the built-in reverse model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def reverse_task_maps(args: argparse.Namespace) -> tuple[torch.Tensor, list[str], list[str], str]:
    """Train on reverse, then the cross-attention ``(layers, heads, T, S)`` of one held-out example."""
    import translate  # the sibling example: python puts this script's folder on sys.path

    targs = translate.parse_args(["--steps", str(args.steps), "--seed", str(args.seed)]
                                 + (["--no-progress"] if args.no_progress else []))
    model, task = translate.train_model(targs)
    source, _ = held_out(task, 1, seed=args.seed + 1)[0]
    model.eval()
    src = torch.tensor([source])
    output = model.generate(src, num_beams=4)  # (1, T + 1), starting with the decoder start token
    with torch.no_grad():
        out = model(src, output[:, :-1], output_attentions=True)
    maps = torch.stack([a[0] for a in out.cross_attentions])  # (layers, heads, T, S)
    rows = [task.decode([t]) or "</s>" for t in output[0, 1:].tolist()]
    cols = [task.decode([t]) or "</s>" for t in source]
    return maps, rows, cols, "cross-attention, reverse task (rows: output, columns: source)"


def checkpoint_maps(args: argparse.Namespace) -> tuple[torch.Tensor, list[str], list[str], str]:
    """Attention of a saved model on ``args.text``: self-attention, or cross-attention for encoder-decoders."""
    model = from_pretrained(args.model)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} holds no tokenizer.json; cannot encode --text")
    model.eval()
    ids = torch.tensor([tokenizer.encode(args.text)])
    names = [tokenizer.decode([t], skip_special_tokens=False) for t in ids[0].tolist()]
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            output = model.generate(ids, num_beams=1)
            out = model(ids, output[:, :-1], output_attentions=True)
            rows = [tokenizer.decode([t], skip_special_tokens=False) for t in output[0, 1:].tolist()]
            return torch.stack([a[0] for a in out.cross_attentions]), rows, names, "cross-attention"
        if not isinstance(model, (DecoderLM, EncoderLM)):
            raise SystemExit(f"cannot plot a {type(model).__name__}")
        out = model(ids, output_attentions=True)
    return torch.stack([a[0] for a in out.attentions]), names, names, f"self-attention of {type(model).__name__}"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a clear exit when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as err:
        raise SystemExit("this example needs matplotlib: pip install matplotlib (or the `plot` extra)") from err
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(plt: Any, maps: torch.Tensor, rows: list[str], cols: list[str], title: str, path: Path) -> None:
    """Draw ``maps`` ``(layers, heads, Lq, Lk)`` as a grid of heat maps and save it as a PNG."""
    layers, heads = maps.shape[:2]
    size = max(2.0, 0.28 * max(len(rows), len(cols)))
    fig, axes = plt.subplots(layers, heads, figsize=(size * heads, size * layers), squeeze=False)
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            ax.imshow(maps[layer, head].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=8)
            ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=6)
            ax.set_yticks(range(len(rows)), rows, fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    """Run the example; returns the PNG's path."""
    args = parse_args(argv)
    plt = pyplot()  # before any training, so a missing matplotlib costs nothing
    torch.manual_seed(args.seed)
    maps, rows, cols, title = checkpoint_maps(args) if args.model else reverse_task_maps(args)
    path = Path(args.out)
    plot(plt, maps, rows, cols, title, path)
    print(f"wrote {path} ({maps.shape[0]} layers x {maps.shape[1]} heads, {len(rows)} x {len(cols)} maps)")
    return path


if __name__ == "__main__":
    main()
