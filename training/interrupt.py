"""Ctrl-C during training, taken at a step boundary: the first SIGINT lets the running optimiser step finish and
then stops the loop with ``TrainingInterrupted`` (so a checkpoint saved then is a consistent one); a second SIGINT
interrupts at once, as Python does by default."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C after a complete optimiser step.

    Args:
        step: the optimiser steps done when it stopped.

    Attributes:
        step: as given.
    """

    def __init__(self, step: int) -> None:
        super().__init__(f"training interrupted after step {step}")
        self.step = step


@contextmanager
def step_boundary_interrupt(enabled: bool = True) -> Iterator[Callable[[], bool]]:
    """While the block runs, the first SIGINT is recorded instead of raised; the block polls the returned function
    (True once Ctrl-C was pressed) between steps. A second SIGINT raises ``KeyboardInterrupt`` at once. Outside the
    main thread, or with ``enabled`` False (several processes, which must stop at the same step), nothing changes
    and the poll stays False.

    Args:
        enabled: whether to defer the first SIGINT.

    Yields:
        The poll: True once Ctrl-C was pressed.
    """
    pressed = threading.Event()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield pressed.is_set
        return
    previous = signal.getsignal(signal.SIGINT)

    def record(signum: int, frame: Any) -> None:
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()

    signal.signal(signal.SIGINT, record)
    try:
        yield pressed.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
