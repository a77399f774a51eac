"""Push a model (with its tokenizer) to a Hugging Face Hub repo and pull it back.

A tiny model and a BPE tokenizer trained on a few sentences are pushed in one commit; the commit is then
downloaded by its sha into the ``huggingface_hub`` cache, reloaded, and its outputs compared bit for bit with
the original's. The token comes from the usual places (``HF_TOKEN``, or ``hf auth login``) and is never printed.

    python examples/hub.py --repo-id you/zoo-demo                          # huggingface.co
    python examples/hub.py --repo-id you/zoo-demo --private --model seq2seq
    python examples/hub.py --repo-id you/zoo-demo --endpoint http://hub.internal:8080   # a self-hosted Hub
"""

from __future__ import annotations

import argparse

import torch

from models import DecoderLM, EncoderLM, Seq2SeqTransformer
from tokenization import train_bpe

CORPUS = [
    "attention is all you need",
    "a zoo of transformer components",
    "push the weights to the hub and pull them back",
    "the encoder reads and the decoder writes",
] * 4

FAMILIES = {
    "decoder": (DecoderLM, "decoder"),
    "encoder": (EncoderLM, "encoder"),
    "seq2seq": (Seq2SeqTransformer, "seq2seq"),
}


def build(family: str) -> tuple[torch.nn.Module, object]:
    """A tiny model of ``family`` and a tokenizer whose vocabulary it covers."""
    cls, template = FAMILIES[family]
    tokenizer = train_bpe(CORPUS, vocab_size=96, min_frequency=1, template=template)
    sizes = dict(vocab_size=len(tokenizer), d_model=32, n_heads=4, d_ff=64, dropout=0.0)
    if cls is Seq2SeqTransformer:
        sizes.update(n_encoder_layers=1, n_decoder_layers=1)
    else:
        sizes.update(n_layers=1)
    special = {k: getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
    return cls.from_preset("tiny", **sizes, **{f"{k}_token_id": v for k, v in special.items()}).eval(), tokenizer


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if isinstance(model, Seq2SeqTransformer):
            return model(ids, ids).logits
        return model(ids).logits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo-id", required=True, help="namespace/name of the model repo (created if missing)")
    parser.add_argument("--endpoint", default=None, help="Hub URL (default: HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--model", choices=sorted(FAMILIES), default="decoder")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", default=None, help="branch to push to (default: main; created if missing)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = build(args.model)
    info = model.push_to_hub(
        args.repo_id, private=args.private, revision=args.revision, tokenizer=tokenizer, endpoint=args.endpoint,
        commit_message=f"transformer-zoo example: {type(model).__name__}",
    )
    print(f"pushed {type(model).__name__} ({model.num_parameters():,} parameters) -> {info.commit_url}")

    pulled = type(model).from_pretrained(args.repo_id, revision=info.oid, endpoint=args.endpoint)
    ids = torch.tensor([tokenizer.encode("attention is all you need")])
    same = torch.equal(logits(model, ids), logits(pulled, ids))
    same_tokens = pulled.tokenizer is not None and pulled.tokenizer.encode("the zoo") == tokenizer.encode("the zoo")
    print(f"pulled {args.repo_id}@{info.oid[:12]}: outputs bit-identical={same}, tokenizer identical={same_tokens}")
    return 0 if same and same_tokens else 1


if __name__ == "__main__":
    raise SystemExit(main())
