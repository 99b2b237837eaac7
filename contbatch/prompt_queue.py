"""Where a running generation takes its next prompt from: a PromptQueue fed while it runs,
or an ordinary iterable.

``LLM`` reads prompts whenever the engine has room for more. An ordinary iterable that
blocks until its producer has the next prompt would then stop the requests already running,
so a PromptQueue tells the reader when to wait: while requests run it takes only what is
queued, and it waits for the next prompt only when the engine has nothing left to do.
"""

import threading
from collections import deque
from collections.abc import Iterable, Iterator


class PromptQueue:
    """A thread-safe queue of prompts that a running ``LLM.iter_generate`` (or ``generate``) reads.

    Producers ``put`` prompts, in any form ``LLM.generate`` takes one, from any thread while the
    generation runs: a prompt put while requests run joins them at the engine's next step,
    without waiting for them to finish. ``close()`` when there are no more; the generation
    then ends once the queued prompts have finished. A producer that fails calls
    ``close(error=exc)`` instead, and the generation stops as if a prompts generator had
    raised ``exc``. Each prompt's RequestOutput carries the ``request_id`` that ``put`` returned.

    Example:
        >>> queue = PromptQueue()
        >>> consumer = threading.Thread(target=lambda: [print(o.outputs[0].text) for o in llm.iter_generate(queue)])
        >>> consumer.start()
        >>> queue.put({"prompt": "Hello", "sampling_params": SamplingParams(max_tokens=8)})
        0
        >>> queue.close()
    """

    def __init__(self) -> None:
        self._items: deque[tuple[int, object]] = deque()
        self._changed = threading.Condition()
        self._next_id = 0
        self._closed = False
        self._error: BaseException | None = None

    def put(self, prompt: object) -> int:
        """Queue one prompt; returns the request_id its RequestOutput will carry."""
        with self._changed:
            if self._closed:
                raise RuntimeError("this PromptQueue is closed: no prompt can be put after close()")
            request_id = self._next_id
            self._next_id += 1
            self._items.append((request_id, prompt))
            self._changed.notify_all()
        return request_id

    def close(self, error: BaseException | None = None) -> None:
        """No more prompts: a generation reading the queue ends after the queued ones. With
        ``error`` (the producer failed) it stops at its next read of the queue instead: the
        reader raises ``error`` (``generate`` as GenerationInterrupted, keeping the finished
        outputs; the requests still running are aborted), so a consumer never waits forever
        for a producer that died."""
        if error is not None and not isinstance(error, BaseException):
            raise TypeError(f"error must be an exception, got {type(error).__name__}")
        with self._changed:
            self._closed = True
            self._error = error
            self._changed.notify_all()

    @property
    def finished(self) -> bool:
        """Closed, and every prompt taken."""
        with self._changed:
            return self._closed and not self._items

    def take(self, wait: bool) -> tuple[int, object] | None:
        """The next (request_id, prompt). When none is queued: None at once if ``wait`` is
        False, else wait for one, or None once the queue is closed. Raises the error the
        queue was closed with, if any."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: self._items or self._closed)
            if self._error is not None:
                raise self._error
            return self._items.popleft() if self._items else None

    def __iter__(self) -> Iterator[object]:
        """The prompts, waiting for each, until the queue is closed."""
        while (taken := self.take(wait=True)) is not None:
            yield taken[1]


class IterableFeed:
    """An ordinary iterable of prompts, read as a PromptQueue is: numbered in order, and
    never waited on apart from what its own ``next()`` does."""

    def __init__(self, prompts: Iterable) -> None:
        self._numbered = enumerate(prompts)
        self.finished = False

    def take(self, wait: bool) -> tuple[int, object] | None:
        if self.finished:  # an iterator need not keep raising StopIteration once it has
            return None
        taken = next(self._numbered, None)
        self.finished = taken is None
        return taken
