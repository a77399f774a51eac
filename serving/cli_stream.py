"""One reply of ``zoo generate`` / ``zoo chat``: the engine's tokens written as they come, Ctrl-C stopping the reply,
and how long the prompt and the generation took (``Timing``, the one-line summary llama.cpp users know)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any


@dataclasses.dataclass
class Timing:
    """How one reply went.

    Attributes:
        prompt_tokens: tokens of the prompt; ``cached_tokens`` of them came from the prefix cache.
        prompt_s: seconds from the request to its first token (the prompt's forward and the first choice).
        generated_tokens: tokens generated.
        generation_s: seconds from the first token to the last.
        finish_reason: ``"stop"``, ``"length"`` (the ``--max-tokens`` limit or the context) or ``"abort"``.
        text: the reply's text.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_s: float = 0.0
    generated_tokens: int = 0
    generation_s: float = 0.0
    finish_reason: str | None = None
    text: str = ""

    def summary(self) -> str:
        """One line: ``prompt: 12 tokens in 0.05 s (240.0 tokens/s) | generation: 64 tokens in 1.20 s (52.5
        tokens/s)`` (the cached prompt tokens named when there are).

        Returns:
            The line.
        """
        computed = self.prompt_tokens - self.cached_tokens
        cached = f", {self.cached_tokens} cached" if self.cached_tokens else ""
        later = max(0, self.generated_tokens - 1)  # the first token's time is the prompt's
        return (f"prompt: {_count(self.prompt_tokens)}{cached} in {self.prompt_s:.2f} s "
                f"({_rate(computed, self.prompt_s)}) | generation: {_count(self.generated_tokens)} in "
                f"{self.generation_s:.2f} s ({_rate(later, self.generation_s)})")


def _count(tokens: int) -> str:
    return f"{tokens} token" + ("" if tokens == 1 else "s")


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:.1f} tokens/s" if seconds > 0 and tokens > 0 else "- tokens/s"


def stream_reply(engine: Any, ids: list[int], params: Any, max_tokens: int, seed: int | None, stdout: Any, *,
                 mark_cut: bool = True, constraint: Any = None) -> Timing:
    """Generate from ``ids``, writing the text to ``stdout`` as it comes; Ctrl-C stops (aborts) this reply only.

    Args:
        engine: a ``serving.engine.Engine`` with nothing else running.
        ids: the prompt's token ids.
        params: the ``SamplingParams``.
        max_tokens: tokens to generate at most (cut to the room the context leaves).
        seed: the sampling seed, or ``None``.
        stdout: where the text goes (a newline ends it; `` [stopped]`` marks Ctrl-C).
        mark_cut: write `` [cut: ...]`` after a reply the length limit ended (``cut_note``).
        constraint: a ``models.generation.constraints.Constraint`` the reply must match, or ``None``.

    Returns:
        The reply's ``Timing`` and text.

    Raises:
        ValueError: the prompt fills the model's context.
    """
    room = engine.context - len(ids)
    if room < 1:
        raise ValueError(f"the prompt ({len(ids)} tokens) fills the model's context of {engine.context} tokens")
    hits = engine.scheduler.prefix_hits
    timing = Timing(prompt_tokens=len(ids))
    started = time.perf_counter()
    first = None
    parts: list[str] = []
    request = engine.add_request(ids, params, max_tokens=min(max_tokens, room), seed=seed, constraint=constraint)
    try:
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.token_ids:
                    now = time.perf_counter()
                    first = now if first is None else first
                    timing.generated_tokens += len(delta.token_ids)
                    timing.generation_s = now - first
                stdout.write(delta.text)
                stdout.flush()
                parts.append(delta.text)
                timing.finish_reason = delta.finish_reason or timing.finish_reason
    except KeyboardInterrupt:
        engine.abort(request)
        timing.finish_reason = "abort"
        stdout.write(" [stopped]")
    finally:
        engine.requests.pop(request, None)
        timing.text = "".join(parts)
    timing.prompt_s = (first if first is not None else time.perf_counter()) - started
    timing.cached_tokens = engine.scheduler.prefix_hits - hits
    if mark_cut and timing.finish_reason == "length":
        stdout.write(f" [{cut_note(timing, max_tokens)}]")
    stdout.write("\n")
    return timing


def cut_note(timing: Timing, max_tokens: int) -> str:
    """Why a reply with ``finish_reason == "length"`` ended: the ``--max-tokens`` limit or the full context.

    Args:
        timing: the reply's ``Timing``.
        max_tokens: the ``--max-tokens`` limit.

    Returns:
        The note.
    """
    if timing.generated_tokens >= max_tokens:
        return f"cut at the {max_tokens}-token limit; raise it with --max-tokens"
    return "cut: the model's context is full (/reset starts again)"
