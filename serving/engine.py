"""``Engine``: continuous batching (Orca) over a paged KV cache (PagedAttention) for any ``DecoderLM``.

One ``step`` = schedule (``serving.scheduler``), one packed forward pass of every scheduled prefill chunk and
decode row (``serving.runner``), then per sequence: record the cached tokens, and for each sequence whose tokens
are all cached choose its next token with its own ``SamplingParams`` and generator, check its stop conditions and
report a ``RequestDelta``. Requests join and leave between any two steps.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from blocks.paged_cache import BlockAllocator
from blocks.prepacked_linear import prepack_linears
from models import DecoderLM
from models.generation.requests import check_token_head
from models.generation.sampling import has_nan, nan_rows
from models.generation.steps import refuse_longrope_switch

from .cache_size import (
    blocks_in_memory,
    check_num_blocks,
    default_num_blocks,
    kv_block_nbytes,
    memory_device,
    resolve_kv_cache_dtype,
)
from .guided import guided_logits, guided_spec
from .lora_registry import LoRAEngineMixin
from .offline import OfflineGenerateMixin
from .requests import (
    IncrementalText,
    RequestDelta,
    RequestOutput,
    RequestSpec,
    Sequence,
    TokenLogprob,
    check_request,
)
from .runner import PagedRunner, check_compile, check_prepack
from .scheduler import Scheduler

__all__ = ["Engine", "QueueFullError", "blocks_in_memory", "kv_block_nbytes"]


class QueueFullError(RuntimeError):
    """``add_request`` found the waiting queue at its bound (``max_waiting``); retry later."""


class Engine(LoRAEngineMixin, OfflineGenerateMixin):
    """Continuous batching over a paged KV cache, with per-request LoRA adapters (``serving.lora_registry``).

    Args:
        model: a ``DecoderLM`` (any family; positional attention biases such as ALiBi are not supported).
        tokenizer: encodes string prompts and decodes outputs and stop strings (``tokenization.Tokenizer`` or
            anything with ``encode(text)`` and ``decode(ids, skip_special_tokens=True)``); default: the one the
            model carries (``model.tokenizer``, set by ``from_pretrained``), if any.
        block_size: positions per cache block.
        num_blocks: blocks in the cache (default: ``max_num_seqs`` full contexts, or as many as half the host's
            available memory holds (90 % of a GPU's free memory) if fewer — the default context is then cut to what
            the cache holds; ``serving.cache_size``); the pools grow as blocks are first used, up to this many, in
            compiled steps too.
        kv_cache_bytes: the cache's memory instead of ``num_blocks``: as many blocks as fit in this many bytes
            (``kv_block_nbytes``: keys and values of every layer, in ``kv_cache_dtype``).
        kv_cache_dtype: the cache's float dtype: ``"auto"`` (the model's), ``"float32"``, ``"float16"`` or
            ``"bfloat16"`` (or the torch dtype): new keys and values are rounded to it when written and attention
            computes in the model's dtype (float16 under a float32 model: half the cache's bytes, as llama.cpp's
            default cache; latent attention's cache keeps the model's dtype).
        max_num_seqs: sequences in one step at most.
        max_num_batched_tokens: tokens in one step at most (prefill chunks are cut to fit).
        max_waiting: requests ``add_request`` queues at most (``QueueFullError`` beyond).
        max_model_len: the context (default ``config.max_len``): prompt + output tokens at most.
        prefix_caching: share full blocks of equal prefixes between requests.
        compile: ``True``: run the steps where every row decodes one token through a compiled graph with
            dynamic row and block counts (``serving.runner``; the first such steps compile: one graph for one row,
            ``serving.single_row``, as ``generate(compile=True)``'s, one for several), and the one-token rows'
            attention in the other steps through one compiled graph; ``"attention"``: only that attention graph
            (compiled at the first step with a decoding row); ``"single"``: the single-row graph for a lone
            decoding row, the other steps as with ``"attention"``; ``"aot"``: the two graphs of ``True`` compiled
            ahead of time in a child process, and a third for steps of 4 or more decoding rows whose products run
            through oneDNN (``serving.aot_steps``: the engine's process holds no compiler; the steps run eagerly
            until the packages are ready, which a later engine of the model loads from disk), the other steps
            eager; ``False``: nothing compiled.
        max_loras: adapters resident at once (0: no adapters, unless ``loras`` are given: then one slot each);
            each request may name one (``adapter=``), rows of different adapters share a step (docs/multi-lora.md).
        max_lora_rank: the largest adapter rank (default: that of ``loras``, at least 16).
        loras: adapters to load now, name -> ``peft`` folder or Hub repo (more with ``add_lora``).
        prepack_weights: hold the model's float32 linear weights of ``MIN_ELEMENTS`` (2^20) elements or more in
            oneDNN's blocked layout instead of their own (``blocks.prepacked_linear``: the model is changed in
            place; same bytes; 16 decoding rows multiplied faster, one row slower, as measured there; tied heads
            and smaller weights stay as they are; ``engine.prepacked`` names the layers); not with adapters.

    Raises:
        NotImplementedError: a model that is not a ``DecoderLM`` (``Seq2SeqTransformer``, ``EncoderLM``), one
            with attention biases, or a ``kv_cache_dtype`` other than a latent-attention model's own.
        ValueError: a limit that is not a positive integer, ``num_blocks`` more than the device's whole memory
            holds, an unknown ``kv_cache_dtype``, or ``prepack_weights`` that is not a bool or comes with adapters.
        RuntimeError: ``prepack_weights`` where torch has no oneDNN (``prepack_linears``, before any change).
    """

    def __init__(
        self, model: Any, tokenizer: Any = None, *, block_size: int = 16, num_blocks: int | None = None,
        max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_waiting: int = 1024,
        max_model_len: int | None = None, prefix_caching: bool = True, compile: bool | str = False,  # noqa: A002
        kv_cache_bytes: int | None = None, max_loras: int = 0, max_lora_rank: int | None = None,
        loras: Any = None, kv_cache_dtype: Any = "auto", prepack_weights: bool = False,
    ) -> None:


        if not isinstance(model, DecoderLM):
            raise NotImplementedError(
                f"Engine serves DecoderLM models; {type(model).__name__} is not supported (use its generate)"
            )
        check_token_head(model, "the engine")
        check_compile(compile)
        if tokenizer is None:
            tokenizer = getattr(model, "tokenizer", None)  # the one a loaded model carries
        context = model.config.max_len if max_model_len is None else max_model_len
        limits = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      max_waiting=max_waiting, max_model_len=context)
        limits["num_blocks"] = 1 if num_blocks is None else num_blocks
        for name, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, model)
        if kv_cache_bytes is not None:
            num_blocks = blocks_in_memory(model, kv_cache_bytes, block_size, num_blocks, kv_dtype)
        device, per_block = memory_device(model), kv_block_nbytes(model, block_size, kv_dtype)
        if num_blocks is None:  # max_num_seqs full contexts, within what the machine holds
            num_blocks = default_num_blocks(per_block, block_size, max_num_seqs, context, device)
            if max_model_len is None:  # a context the cache cannot hold is not the default
                context = min(context, num_blocks * block_size)
        else:
            check_num_blocks(num_blocks, per_block, block_size, device)
        if context < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt and one new token), got {context}")
        check_prepack(prepack_weights, max_loras, loras)
        self.prepacked: list[str] = prepack_linears(model.eval()) if prepack_weights else []
        self.model, self.tokenizer = model, tokenizer
        self.context, self.max_waiting = context, max_waiting
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.scheduler = Scheduler(self.allocator, max_num_seqs, max_num_batched_tokens, prefix_caching)
        self.runner = PagedRunner(model, num_blocks, block_size, compile, kv_dtype)
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.peak_blocks = 0  # most blocks in use at once
        self.enable_loras(max_loras, max_lora_rank, loras, max_num_batched_tokens)
        self.runner.start_aot()  # compile="aot": the model's structure is final (LoRA slots added)

    # ----------------------------------------------------------------------------------------------- requests
    def make_request(self, prompt: Any, sampling: Any = None, *, max_tokens: Any = 16, stop: Any = None,
                     n: Any = 1, seed: Any = None, logprobs: Any = None, constraint: Any = None,
                     logit_bias: Any = None, adapter: Any = None) -> RequestSpec:
        """Check one request's arguments (as ``generate`` takes them for one prompt) without queueing it.

        Args:
            prompt: a string (needs the tokenizer) or a list of token ids.
            sampling: ``SamplingParams`` (default greedy).
            max_tokens: new tokens per sample at most.
            stop: stop strings and/or stop token ids.
            n: samples of the prompt.
            seed: the first sample's generator seed (None: drawn).
            logprobs: report log-probabilities (and this many most likely ones).
            constraint: a ``Constraint`` the output must match, or None.
            logit_bias: ``{token_id: bias}`` added to the logits.
            adapter: the name of a loaded LoRA adapter, or None.

        Returns:
            The checked request (``enqueue`` queues it).

        Raises:
            ValueError: bad arguments (see ``generate``).
        """
        config = self.model.config
        spec = check_request(
            prompt, sampling, max_tokens, stop, n, seed, logprobs, tokenizer=self.tokenizer,
            vocab_size=config.vocab_size, context=self.context, eos=config.eos_token_id,
            cache_tokens=self.allocator.n_blocks * self.allocator.block_size,
        )
        # The paged cache keeps rotated keys: a request may not cross a LongRoPE switch (ValueError).
        refuse_longrope_switch(self.model, len(spec.prompt), len(spec.prompt) + spec.max_tokens, "the engine")
        spec = guided_spec(spec, constraint, logit_bias, self.tokenizer, config.vocab_size, config.eos_token_id)
        return self.with_adapter(spec, adapter)

    def add_request(self, prompt: Any, sampling: Any = None, *, max_tokens: Any = 16, stop: Any = None, n: Any = 1,
                    seed: Any = None, logprobs: Any = None, request_id: str | None = None, constraint: Any = None,
                    logit_bias: Any = None, adapter: Any = None) -> str:
        """Queue one request; return its id. Its tokens come from ``step`` as ``RequestDelta`` objects.

        Args:
            prompt: a string (needs the tokenizer) or a list of token ids.
            sampling: ``SamplingParams`` (default greedy).
            max_tokens: new tokens per sample at most.
            stop: stop strings and/or stop token ids.
            n: samples of the prompt.
            seed: the first sample's generator seed (None: drawn).
            logprobs: report log-probabilities (and this many most likely ones).
            constraint: a ``Constraint`` the output must match, or None.
            logit_bias: ``{token_id: bias}`` added to the logits.
            adapter: the name of a loaded LoRA adapter, or None.
            request_id: the id to use (default: a fresh ``req-N``).

        Returns:
            The request's id.

        Raises:
            ValueError: bad arguments (see ``generate``) or a request id in use.
            QueueFullError: ``max_waiting`` requests are waiting already.
        """
        spec = self.make_request(prompt, sampling, max_tokens=max_tokens, stop=stop, n=n, seed=seed,
                                 logprobs=logprobs, constraint=constraint, logit_bias=logit_bias, adapter=adapter)
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting (max_waiting={self.max_waiting})")
        return self.enqueue(spec, request_id)

    def enqueue(self, spec: RequestSpec, request_id: str | None = None) -> str:
        """Queue a checked request (no queue bound); return its id.

        Args:
            spec: what ``make_request`` returned.
            request_id: the id to use (default: a fresh ``req-N``).

        Returns:
            The request's id.

        Raises:
            ValueError: ``request_id`` is in use.
        """
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is in use")
        seed = spec.seed
        if seed is None and spec.params.do_sample:
            seed = int(torch.randint(0, 2**62, (1,)))  # from torch's global generator: torch.manual_seed repeats it
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        seq = Sequence(request_id, 0, spec, generator, next(self._arrivals))
        seq.guide = None if spec.constraint is None else spec.constraint.start()
        self.requests[request_id] = [seq]
        self.scheduler.waiting.append(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request (all its samples) now; its blocks are released.

        Args:
            request_id: the request's id.

        Returns:
            Whether it was cancelled (False if it is unknown or done).
        """
        seqs = self.requests.get(request_id)
        if seqs is None or all(s.finish_reason for s in seqs):
            return False
        for seq in seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return True

    def has_unfinished(self) -> bool:
        """Whether some request is waiting or running.

        Returns:
            True while ``step`` has work to do.
        """
        return bool(self.scheduler.waiting or self.scheduler.running)

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request; the engine forgets it.

        Args:
            request_id: the request's id.

        Returns:
            Its ``RequestOutput`` (lists per sample when ``n > 1``).

        Raises:
            ValueError: the request is not finished.
            KeyError: no such request.
        """
        seqs = self.requests[request_id]
        if any(s.finish_reason is None for s in seqs):
            raise ValueError(f"request {request_id!r} is not finished")
        del self.requests[request_id]
        spec = seqs[0].spec
        fields = [(s.output, s.text, s.finish_reason, s.logprobs if spec.logprobs is not None else None)
                  for s in sorted(seqs, key=lambda s: s.index)]
        if spec.n == 1:
            return RequestOutput(request_id, list(spec.prompt), *fields[0])
        return RequestOutput(request_id, list(spec.prompt), *(list(column) for column in zip(*fields, strict=True)))

    # ------------------------------------------------------------------------------------------------ steps
    def step(self) -> list[RequestDelta]:
        """Run one iteration: schedule, one forward pass, choose tokens.

        Returns:
            One delta per sample that gained a token or finished (none for a step of prefill chunks only).
        """
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        used = self.allocator.n_blocks - self.allocator.num_free
        self.peak_blocks = max(self.peak_blocks, used)
        self.route_loras(scheduled)
        logits = self.runner.run(
            [t for seq, n in scheduled for t in seq.tokens[seq.num_computed:seq.num_computed + n]],
            [(n, seq.num_computed + n, seq.block_table) for seq, n in scheduled],
        )
        deltas = []
        bad = set(nan_rows(logits).nonzero().flatten().tolist()) if has_nan(logits) else set()
        raw, logits = logits, guided_logits(logits, scheduled)  # constraints and logit_bias, all rows together
        greedy = None  # every row's argmax, computed once for the rows that choose plainly greedily
        for row, (seq, n) in enumerate(scheduled):
            self.scheduler.computed(seq, n)
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk: nothing to choose yet
            if row in bad:  # nothing to choose from: the request ends with "error"
                deltas += self._fail(seq.request_id, "its next-token logits are NaN (the model's weights or inputs "
                                                      "hold NaN or inf values)")
                continue
            try:  # isolated per row: whatever fails here fails this request only, never the batch
                samples = [seq]
                if seq.spec.n > 1 and not seq.forked:
                    samples += self._fork(seq)
                params = seq.spec.params
                token = None
                if not (params.do_sample or params.uses_history or params.uses_counts):
                    greedy = logits.float().argmax(dim=-1).tolist() if greedy is None else greedy
                    token = greedy[row]
                for sample in samples:
                    deltas.append(self._choose(sample, logits[row], token, raw[row]))
            except Exception as err:  # noqa: BLE001 - reported as this request's "error" finish
                deltas += self._fail(seq.request_id, f"choosing its next token failed: {type(err).__name__}: {err}")
        return deltas

    def _fail(self, request_id: str, reason: str) -> list[RequestDelta]:
        """End every unfinished sample of a request whose next token cannot be chosen (NaN logits, or a failure in
        its own sampling step): ``finish_reason="error"`` (``reason`` kept as the samples' ``error``), blocks
        released, the other requests of the batch unaffected."""
        deltas = []
        seqs = self.requests[request_id]
        blocks = {b for seq in seqs for b in seq.block_table}
        for i in range(seqs[0].spec.n):
            seq = next((s for s in seqs if s.index == i), None)
            if seq is None or seq.finish_reason is None:
                if seq is not None:
                    seq.finish_reason, seq.error = "error", reason
                    self.scheduler.finish(seq)
                deltas.append(RequestDelta(request_id, i, [], "", "error"))  # also for samples not forked yet
        freed = [b for b in blocks if self.allocator.refs[b] == 0]  # blocks another request holds stay as they are
        for block in freed:
            self.allocator.forget(block)
        self.runner.scrub(freed)
        return deltas

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """The other samples of ``parent``'s request, sharing its prompt blocks, each with generator seed + index
        (modulo 2**64, the generator's range: a seed near its top does not overflow)."""
        parent.forked = True
        seed = parent.generator.initial_seed()
        children = []
        for j in range(1, parent.spec.n):
            child = Sequence(parent.request_id, j, parent.spec, torch.Generator().manual_seed((seed + j) % 2**64),
                             parent.arrival, tokens=list(parent.tokens), forked=True)
            child.guide = None if parent.guide is None else parent.guide.copy()
            self.scheduler.fork(parent, child)
            self.requests[parent.request_id].append(child)
            children.append(child)
        return children

    def _choose(self, seq: Sequence, logits: Tensor, token: int | None = None, raw: Tensor | None = None
                ) -> RequestDelta:
        """Choose ``seq``'s next token from its logits ``(V,)`` (``token``: already chosen, a plain greedy row;
        ``raw``: the logits before its constraint and logit bias, whose log-probabilities are reported)."""
        spec = seq.spec
        row = logits[None]  # (1, V)
        if spec.params.uses_history and seq.seen is None:
            seq.seen = torch.zeros(1, row.shape[-1], dtype=torch.bool)
            seq.seen[0, seq.tokens] = True
        if spec.params.uses_counts and seq.counts is None:
            output = torch.tensor(seq.output, dtype=torch.long)
            seq.counts = torch.bincount(output, minlength=row.shape[-1]).to(torch.int32)[None]
        if token is None:
            token = int(spec.params.next_tokens(row, seq.seen, seq.generator, seq.counts)[0])
        if seq.seen is not None:
            seq.seen[0, token] = True
        if seq.counts is not None:
            seq.counts[0, token] += 1
        if seq.guide is not None:
            seq.guide.advance(token)
        if spec.logprobs is not None:
            logprobs = (row[0] if raw is None else raw).float().log_softmax(-1)
            top = logprobs.topk(spec.logprobs) if spec.logprobs else None
            seq.logprobs.append(TokenLogprob(
                token, float(logprobs[token]),
                {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)),
            ))
        seq.tokens.append(token)
        output = seq.output
        if token in spec.stop_ids:
            seq.finish_reason = "stop"
        elif len(output) >= spec.max_tokens or len(seq.tokens) >= self.context:
            seq.finish_reason = "length"
        hold = 0
        if self.tokenizer is not None:
            # Decoded a window at a time (a character whose bytes have not all come yet waits for them, so the
            # deltas join to the decoded output); the stop token itself is not text.
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalText(self.tokenizer)
            searched = len(seq.text)
            if token not in spec.stop_ids:
                seq.detokenizer.add([token])
            seq.text = seq.detokenizer.text if seq.finish_reason is None else seq.detokenizer.finish()
            if spec.stop_strings:
                # The text only grows: a stop string not found before can only end in what is new.
                longest = max(len(s) for s in spec.stop_strings)
                start = max(0, searched - longest + 1)
                cut = min((i for i in (seq.text.find(s, start) for s in spec.stop_strings) if i >= 0), default=-1)
                if cut >= 0:
                    seq.text, seq.finish_reason = seq.text[:cut], "stop"
                elif seq.finish_reason is None:
                    hold = longest - 1  # what could be the start of a stop string waits until it is decided
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
        shown = max(seq.sent_text, len(seq.text) - hold)
        delta = RequestDelta(
            seq.request_id, seq.index, output[seq.sent_tokens:], seq.text[seq.sent_text:shown], seq.finish_reason,
            seq.logprobs[seq.sent_tokens:] if spec.logprobs is not None else None,
        )
        seq.sent_tokens, seq.sent_text = len(output), shown
        return delta
