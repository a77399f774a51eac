"""The zoo as an lm-evaluation-harness model, registered as ``zoo``.

    lm_eval's registry learns the name when this module is imported (lm-eval has no plugin entry points): ``zoo eval``
    imports it, and ``python -m cli.lm_eval run --model zoo --model_args pretrained=PATH --tasks ...`` runs lm-eval's
    own command line with it registered.

Requests are tokenized as lm-eval's ``hf`` backend tokenizes them (``TemplateLM``: trailing spaces of the context
move to the continuation; the tokenizer's own special tokens unless ``add_bos_token`` says otherwise; an empty
context conditions on BOS), so both backends score the same tokens. ``loglikelihood`` runs each shared context once
and its continuations batched after it (``serving.loglikelihood``); ``loglikelihood_rolling`` cuts long texts into
lm-eval's disjoint rolling windows; ``generate_until`` runs every prompt through the zoo's engine (continuous
batching, greedy unless the task samples) and cuts at the task's stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm.auto import tqdm

from models.generation.sampling import SamplingParams

from .engine import Engine
from .loglikelihood import continuation_logprobs


def _flag(value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


@register_model("zoo")
class ZooLM(TemplateLM):
    """A zoo ``DecoderLM`` for lm-eval.

    Args:
        pretrained: a checkpoint folder, Hub repo id or ``.gguf`` file (``models.from_pretrained``), or a loaded model.
        batch_size: requests per forward pass for the log-likelihoods (lm-eval passes ``--batch_size``; ``auto``
            means 16).
        max_length: the context in tokens (default: the model's ``max_len``).
        add_bos_token: as the ``hf`` backend: None uses the tokenizer's own special tokens.
        max_gen_toks: new tokens per generation at most when a task does not say.
        device: where the model runs (default: where it is).
        adapter: a LoRA adapter folder to load and run (peft layout).

    Raises:
        ValueError: a model without a tokenizer, or bad arguments.
    """

    def __init__(self, pretrained: Any, batch_size: int | str | None = 16, max_length: int | None = None,
                 add_bos_token: Any = None, max_gen_toks: int = 256, device: str | None = None,
                 adapter: str | None = None, **unused: Any) -> None:
        super().__init__()
        unknown = sorted(set(unused) - {"dtype", "trust_remote_code", "parallelize", "max_batch_size"})
        if unknown:
            raise ValueError(f"unknown model_args for the zoo backend: {unknown}; expected pretrained, batch_size, "
                             "max_length, add_bos_token, max_gen_toks, device, adapter")
        if isinstance(pretrained, str):
            import models

            model = models.from_pretrained(pretrained)
        else:
            model = pretrained
        if adapter:
            model.load_adapter(adapter)
        if device:
            model.to(device)
        self.model = model.eval()
        self.tokenizer = getattr(model, "tokenizer", None)
        if self.tokenizer is None:
            raise ValueError("the model has no tokenizer; lm-eval scores text")
        self.batch_size = 16 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self._max_length = int(max_length) if max_length else int(model.config.max_len)
        self.add_bos_token = _flag(add_bos_token)
        self.max_gen_toks = int(max_gen_toks)
        self._engine: Engine | None = None

    # ------------------------------------------------------------------ tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "zoo"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of ``string`` (special tokens as the ``hf`` backend adds them).

        Args:
            string: the text.
            add_special_tokens: whether to add the tokenizer's special tokens (None: as ``add_bos_token`` says,
                and not when ``string`` already starts with the BOS token).
            left_truncate_len: keep only the last this many ids (None: all).
            **kwargs: other lm-eval arguments, ignored.

        Returns:
            The token ids.
        """
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            bos = self.tokenizer.special_tokens.get("bos")
            if bos and string.startswith(bos):
                add_special_tokens = False
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        if self.add_bos_token and add_special_tokens and (not ids or ids[0] != self.prefix_token_id):
            ids = [self.prefix_token_id, *ids]
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        """The text of token ids.

        Args:
            tokens: the ids.

        Returns:
            Their decoded text.
        """
        return self.tokenizer.decode(list(tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered with the tokenizer's template (lm-eval's ``--apply_chat_template``).

        Args:
            chat_history: the messages (``role`` and ``content``).
            add_generation_prompt: end with the start of the assistant's turn.

        Returns:
            The rendered prompt text.
        """
        return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    # ------------------------------------------------------------------ log-likelihoods
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm)
        try:
            return continuation_logprobs(self.model, [(c, k) for _, c, k in requests], batch_size=self.batch_size,
                                         max_length=self.max_length, pad_id=self.tokenizer.pad_token_id or 0,
                                         progress=bar.update)
        finally:
            bar.close()

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of whole texts, in lm-eval's disjoint rolling windows of ``max_length`` tokens.

        Args:
            requests: lm-eval instances whose ``args`` are ``(text,)``.
            disable_tqdm: hide the progress bar.

        Returns:
            Each text's total log-likelihood, in order.
        """
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logp, _) in zip(owners, scores, strict=True):
            totals[owner] += logp
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continue every context with the engine until a stop string, EOS or ``max_gen_toks``.

        Args:
            requests: lm-eval instances whose ``args`` are ``(context, gen_kwargs)`` (``until``, ``max_gen_toks``,
                ``temperature``, ``do_sample``, ``top_p``, ``top_k``).
            disable_tqdm: hide the progress bar.

        Returns:
            Each continuation's text, cut before its first stop string, in order.
        """
        if self._engine is None:
            self._engine = Engine(self.model, self.tokenizer, max_model_len=self.max_length)
        prompts, settings, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs or {})
            until = kwargs.pop("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            ids = self.tok_encode(context, left_truncate_len=max(self.max_length - max_new, 1))
            max_new = max(1, min(max_new, self.max_length - len(ids)))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            do_sample = bool(kwargs.pop("do_sample", False)) and temperature > 0
            sampling = SamplingParams(do_sample=do_sample, temperature=temperature if do_sample else 1.0,
                                      top_p=kwargs.pop("top_p", None) if do_sample else None,
                                      top_k=kwargs.pop("top_k", None) if do_sample else None)
            prompts.append(ids)
            settings.append((sampling, max_new))
            stops.append(until)
        outputs = self._engine.generate(prompts, [s for s, _ in settings], max_tokens=[m for _, m in settings],
                                        stop=[u or None for u in stops])
        texts = []
        for out, until in zip(tqdm(outputs, desc="generate_until", disable=disable_tqdm), stops, strict=True):
            text = out.text
            for term in until:
                if term:
                    text = text.split(term)[0]
            texts.append(text)
        return texts
