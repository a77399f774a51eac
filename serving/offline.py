"""``Engine.generate``: the offline API, every prompt queued at once and stepped until all are done."""

from __future__ import annotations

from typing import Any

from .requests import RequestOutput, per_prompt, stop_is_per_prompt


class OfflineGenerateMixin:
    """``generate`` over an engine's ``make_request``, ``enqueue``, ``step`` and ``pop_output`` (``serving.Engine``)."""

    def generate(self, prompts: Any, sampling: Any = None, *, max_tokens: Any = 16, stop: Any = None, n: Any = 1,
                 seed: Any = None, logprobs: Any = None, constraint: Any = None,
                 logit_bias: Any = None, adapter: Any = None) -> list[RequestOutput]:
        """Continue every prompt, all of them batched continuously; one ``RequestOutput`` per prompt, in order.

        Each of ``sampling`` … ``adapter`` is one value for all prompts or a list with one per prompt.

        Args:
            prompts: a list of prompts, each a string (needs the tokenizer) or a list of token ids; one string or
                one list of ids is a single prompt.
            sampling: ``SamplingParams`` (default greedy).
            max_tokens: new tokens per sample at most (>= 1); the context may end a sample earlier.
            stop: stop strings and/or stop token ids (the model's EOS always stops).
            n: samples per prompt (>= 1; > 1 needs sampling); they share the prompt's cache blocks.
            seed: sample ``j`` draws from a generator seeded ``seed + j`` (None: drawn from torch's generator).
            logprobs: report the log-probability of each new token and of the ``logprobs`` most likely ones.
            constraint: a ``models.generation.constraints.Constraint`` the output must match (compiled once per
                distinct constraint; each sample keeps its own state), or None.
            logit_bias: ``{token_id: bias}`` added to the logits before choosing (OpenAI's; -100 bans a token).
            adapter: the name of a loaded LoRA adapter to run with (None: the base model).

        Returns:
            One ``RequestOutput`` per prompt.

        Raises:
            ValueError: naming the bad value: an empty prompt, ids outside the vocabulary, a prompt as long as the
                context, ``max_tokens <= 0``, ``n < 1``, a request the whole cache cannot hold, … — all checked
                before anything runs.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"prompts must be a non-empty list of prompts, got {prompts!r:.60}")
        count = len(prompts)
        columns = [per_prompt(sampling, count, "sampling"), per_prompt(max_tokens, count, "max_tokens"),
                   per_prompt(stop, count, "stop", stop_is_per_prompt), per_prompt(n, count, "n"),
                   per_prompt(seed, count, "seed"), per_prompt(logprobs, count, "logprobs"),
                   per_prompt(constraint, count, "constraint"), per_prompt(logit_bias, count, "logit_bias"),
                   per_prompt(adapter, count, "adapter")]
        specs = []
        for i, (prompt, *args) in enumerate(zip(prompts, *columns, strict=True)):
            try:
                specs.append(self.make_request(prompt, args[0], max_tokens=args[1], stop=args[2], n=args[3],
                                               seed=args[4], logprobs=args[5], constraint=args[6],
                                               logit_bias=args[7], adapter=args[8]))
            except ValueError as error:
                raise ValueError(f"prompt {i}: {error}") from None
        ids = [self.enqueue(spec) for spec in specs]
        pending = set(ids)
        while pending:
            self.step()
            pending = {r for r in pending if any(s.finish_reason is None for s in self.requests[r])}
        failed = {i: next(s.error for s in self.requests[r] if s.finish_reason == "error") for i, r in enumerate(ids)
                  if any(s.finish_reason == "error" for s in self.requests[r])}
        outputs = [self.pop_output(r) for r in ids]
        if failed:
            reasons = "; ".join(sorted({f"{reason}" for reason in failed.values()}))
            raise ValueError(f"no next token could be chosen for prompt(s) {sorted(failed)}: {reasons}")
        return outputs
