"""Ctrl-C lands between engine steps, never inside one.

A KeyboardInterrupt raised in the middle of a step (between the scheduler's bookkeeping and
the block manager's, say) could leave the engine's state half updated, so ``LLM.generate``
could neither hand back the requests already finished nor run again. While a step runs,
``StepInterrupts`` therefore holds a first SIGINT back and raises it once the step is done
and its finished outputs are handed on; a second SIGINT in the same step raises at once, as
a user who presses Ctrl-C twice expects.

It only does this in the main thread and only while SIGINT has Python's default handler:
a program with its own handler (the ``contbatch generate`` CLI, a notebook kernel's custom
one) keeps it.
"""

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class StepInterrupts:
    """``with interrupts.deferred(): step()``, then ``interrupts.raise_pending()`` once the
    step's results are safe."""

    def __init__(self) -> None:
        self._pending = False

    @contextmanager
    def deferred(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread() or (
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        ):
            yield
            return
        signal.signal(signal.SIGINT, self._handle)  # installed only while a step runs
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def raise_pending(self) -> None:
        """Raise the KeyboardInterrupt held back during the last step, if there was one."""
        if self._pending:
            self._pending = False
            raise KeyboardInterrupt

    def _handle(self, signum: int, frame: object) -> None:
        if self._pending:  # the second Ctrl-C of this step
            self._pending = False
            raise KeyboardInterrupt
        self._pending = True
