"""A tiny ``transformers`` Llama checkpoint (random weights, a byte-level BPE tokenizer with a ChatML template) that
the zoo, TRL and lm-evaluation-harness all load: the shared subject of the fine-tuning and evaluation tests."""

from __future__ import annotations

from pathlib import Path

import tokenizers
import tokenizers.processors
import torch

from tokenization import train_byte_level_bpe

CORPUS = ["The quick brown fox jumps over the lazy dog. What does the function do? It returns the answer.",
          "Paris is the capital of France. Berlin is the capital of Germany. 2+2=4 and 3+3=6."]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_llama(folder: Path, *, seed: int = 0) -> Path:
    """Write the checkpoint to ``folder`` (``config.json``, ``model.safetensors``, the tokenizer files).

    Returns:
        ``folder``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    base = train_byte_level_bpe(CORPUS * 4, vocab_size=300, min_frequency=1)
    base.backend.add_special_tokens(SPECIALS)
    # Llama's post-processing: BOS before the text, nothing after it.
    base.backend.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", base.backend.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(base.to_str()), bos_token="<s>",
                                  eos_token="</s>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init's, so the log-likelihoods differ clearly between texts
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
