"""Perplexity of a text file as llama.cpp's ``llama-perplexity`` measures it, so figures compare with the CPU world's.

The whole text is tokenized once (with the tokenizer's own special tokens, i.e. BOS where the model family has one)
and cut into ``n_chunks = len(tokens) // n_ctx`` chunks of ``n_ctx`` tokens (the rest is dropped; at least two
chunks' worth of tokens are required, as llama.cpp requires). Each chunk's first token is replaced by BOS when the
tokenizer has one; the model reads the chunk and only the second half is scored: the tokens at positions
``n_ctx // 2 + 1 … n_ctx − 1``, each predicted from everything before it in the chunk, so every scored token has at
least half a context behind it. The estimate after ``k`` chunks is ``exp(mean NLL)`` over the tokens scored so far;
the uncertainty is llama.cpp's standard error of the mean NLL carried through ``exp``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm


@dataclass(frozen=True)
class PerplexityResult:
    """What ``perplexity`` measured.

    Attributes:
        perplexity: the final estimate, ``exp(mean NLL)``.
        uncertainty: its ± (llama.cpp's standard error, through ``exp``).
        running: the estimate after each chunk.
        n_ctx, n_chunks, n_scored: the chunk length, the chunks read and the tokens scored.
        nll: the per-token negative log-likelihoods, chunk after chunk.
    """

    perplexity: float
    uncertainty: float
    running: list[float]
    n_ctx: int
    n_chunks: int
    n_scored: int
    nll: list[float]


def chunk_tokens(tokens: list[int], n_ctx: int, bos_token_id: int | None, max_chunks: int | None = None) -> Tensor:
    """The chunks llama.cpp reads: ``(n_chunks, n_ctx)`` with BOS (if any) as each chunk's first token.

    Args:
        tokens: the token ids of the whole text.
        n_ctx: the context length of each chunk.
        bos_token_id: the BOS id that replaces each chunk's first token, or None to keep it.
        max_chunks: the most chunks to take, or None for all full chunks.

    Returns:
        The chunks, long.

    Shapes: -> ``(n_chunks, n_ctx)``.

    Raises:
        ValueError: ``n_ctx`` < 4, or fewer than ``2 * n_ctx`` tokens.
    """
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 4:
        raise ValueError(f"n_ctx must be an integer >= 4, got {n_ctx!r}")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} needs at least "
                         f"{2 * n_ctx} (two chunks), as llama-perplexity does")
    n_chunks = len(tokens) // n_ctx
    if max_chunks is not None:
        n_chunks = min(n_chunks, max_chunks)
    chunks = torch.tensor(tokens[: n_chunks * n_ctx], dtype=torch.long).view(n_chunks, n_ctx).clone()
    if bos_token_id is not None:
        chunks[:, 0] = bos_token_id
    return chunks


def perplexity(
    model: nn.Module,
    tokens: list[int],
    n_ctx: int,
    *,
    bos_token_id: int | None = None,
    batch_size: int = 1,
    max_chunks: int | None = None,
    progress: bool = True,
    on_chunk: Callable[[int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``tokens`` by llama.cpp's method (see the module docstring).

    Args:
        model: a causal LM whose forward takes ``(B, L)`` ids and returns ``.logits``.
        tokens: the tokenized text.
        n_ctx: the chunk length (the context the model reads).
        bos_token_id: the first token of every chunk (None keeps the text's own).
        batch_size: chunks per forward pass.
        max_chunks: read at most this many chunks (llama.cpp's ``--chunks``).
        progress: show a progress bar with the running estimate.
        on_chunk: called with ``(chunk number from 1, running estimate)`` after each chunk.

    Returns:
        A ``PerplexityResult``.

    Raises:
        ValueError: as ``chunk_tokens``, or a bad ``batch_size``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    chunks = chunk_tokens(tokens, n_ctx, bos_token_id, max_chunks)
    first = n_ctx // 2
    device = next(model.parameters()).device
    nll_sum, nll2_sum, count = 0.0, 0.0, 0
    running, nlls = [], []
    bar = tqdm(total=len(chunks), desc="perplexity", unit="chunk", disable=not progress)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for start in range(0, len(chunks), batch_size):
            batch = chunks[start:start + batch_size].to(device)
            logits = model(batch).logits[:, first:-1].double()  # (b, n_ctx - 1 - first, V)
            targets = batch[:, first + 1:]
            nll = -torch.gather(logits.log_softmax(-1), 2, targets.unsqueeze(-1)).squeeze(-1)  # (b, scored)
            for row in nll.tolist():
                nll_sum += sum(row)
                nll2_sum += sum(x * x for x in row)
                count += len(row)
                nlls.extend(row)
                running.append(math.exp(nll_sum / count))
                if on_chunk is not None:
                    on_chunk(len(running), running[-1])
            bar.set_postfix(ppl=f"{running[-1]:.4f}", refresh=False)
            bar.update(len(batch))
    bar.close()
    model.train(was_training)
    mean = nll_sum / count
    variance = nll2_sum / count - mean * mean
    error = math.sqrt(max(variance, 0.0) / (count - 1)) if count > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(perplexity=ppl, uncertainty=error * ppl, running=running, n_ctx=n_ctx,
                            n_chunks=len(chunks), n_scored=count, nll=nlls)
