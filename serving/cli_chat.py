"""``zoo chat``: a conversation through the model's chat template, each answer streamed as it is generated.

Lines starting with ``/`` are commands (``COMMANDS``; ``/help`` lists them); an unknown one is refused, never sent to
the model, and ``//text`` sends ``/text``. Ctrl-C during an answer stops that answer; EOF or ``/exit`` ends.
"""

from __future__ import annotations

from typing import Any

from .cli_stream import Timing, stream_reply

COMMANDS = {
    "/help": "list these commands",
    "/reset": "clear the history (the system message stays)",
    "/system TEXT": "set the system message (and clear the history); /system alone removes it",
    "/timings": "print the prompt and generation speed after each answer (again: stop)",
    "/exit": "end the chat (or Ctrl-D)",
}


class ChatSession:
    """The history and settings of one chat; ``handle(line)`` answers one input line.

    Args:
        engine: a ``serving.engine.Engine`` of the model.
        tokenizer: the model's tokenizer, with a chat template.
        params: the ``SamplingParams`` of every answer.
        max_tokens: tokens per answer at most.
        seed: the sampling seed (``None``: a fresh one per answer).
        system: the system message, or ``None``.
        timings: print a ``Timing`` line after each answer.
        constraint: a ``models.generation.constraints.Constraint`` every answer must match, or ``None``.
    """

    def __init__(self, engine: Any, tokenizer: Any, params: Any, *, max_tokens: int, seed: int | None = None,
                 system: str | None = None, timings: bool = False, constraint: Any = None) -> None:
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.max_tokens, self.seed, self.system, self.timings = max_tokens, seed, system, timings
        self.constraint = constraint
        self.messages: list[dict[str, str]] = []
        self.last: Timing | None = None

    def handle(self, line: str, stdout: Any) -> bool:
        """Answer one input line (a message or a command).

        Args:
            line: the line read.
            stdout: where the answer goes.

        Returns:
            False when the chat should end.
        """
        text = line.rstrip("\n")
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text.strip(), stdout)
        text = text[1:] if text.startswith("//") else text
        if not text.strip():
            return True
        turn = [*([{"role": "system", "content": self.system}] if self.system else []), *self.messages,
                {"role": "user", "content": text}]
        try:
            ids = self.tokenizer.apply_chat_template(turn, add_generation_prompt=True)
            timing = stream_reply(self.engine, ids, self.params, self.max_tokens, self.seed, stdout,
                                  constraint=self.constraint)
        except ValueError as err:
            stdout.write(f"[{err}; /reset to start again]\n")
            return True
        self.last = timing
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": timing.text}]
        if self.timings:
            stdout.write(f"[{timing.summary()}]\n")
        return True

    def command(self, text: str, stdout: Any) -> bool:
        """Run one slash command.

        Args:
            text: the command line (``/name rest``).
            stdout: where its answer goes.

        Returns:
            False for ``/exit``.
        """
        name, _, rest = text.partition(" ")
        if name == "/exit":
            return False
        if name == "/help":
            width = max(len(c) for c in COMMANDS)
            stdout.write("".join(f"  {c.ljust(width)}  {what}\n" for c, what in COMMANDS.items()))
            stdout.write(f"  {'//TEXT'.ljust(width)}  send a message that starts with /TEXT\n")
        elif name == "/reset" and not rest.strip():
            self.messages = []
            kept = "; the system message is kept (/system alone removes it)" if self.system else ""
            stdout.write(f"[history cleared{kept}]\n")
        elif name == "/system":
            self.messages, self.system = [], rest.strip() or None
            stdout.write("[system message set; history cleared]\n" if self.system else
                         "[system message removed; history cleared]\n")
        elif name == "/timings" and not rest.strip():
            self.timings = not self.timings
            stdout.write(f"[timings {'on' if self.timings else 'off'}]\n")
            if self.timings and self.last is not None:
                stdout.write(f"[last answer: {self.last.summary()}]\n")
        else:
            stdout.write(f"[unknown command {text!r}: /help lists the commands; //TEXT sends /TEXT]\n")
        return True


def run_chat(session: ChatSession, stdin: Any, stdout: Any) -> None:
    """Read lines from ``stdin`` until EOF or ``/exit``, answering each; Ctrl-C at the prompt starts a new line.

    Args:
        session: the chat.
        stdin: the terminal's input (a banner when it is a terminal).
        stdout: the terminal's output.
    """
    if getattr(stdin, "isatty", lambda: False)():
        stdout.write("[/help lists the commands; Ctrl-C stops an answer, Ctrl-D ends]\n")
    while True:
        stdout.write("> ")
        stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            stdout.write("\n")
            continue
        if not line:  # EOF (Ctrl-D)
            stdout.write("\n")
            return
        if not session.handle(line, stdout):
            return
