"""How the client's logic is written once for the sync and the asyncio client: as a generator of
steps. Each step it yields is an I/O it waits on, a zero-argument callable of the client class
(a blocking call in the sync client, a coroutine function in the asyncio one); the yield gives
back the I/O's result, or raises its error there, so the logic reads as straight-line code with
`yield` where the asyncio client would `await`. `run_blocking` and `run_awaiting` perform the
steps: the only place where the two clients differ in how they wait."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeVar

T = TypeVar("T")
IO = Callable[[], Any]  # one I/O: a blocking call, or a coroutine function to await
Steps = Generator[IO, Any, T]  # yields I/O, receives each one's result, returns a T


class _Walk:
    """One run of a generator of steps: the I/O it now waits on (`io`) until it is `done`, and then
    what it returned (`value`)."""

    def __init__(self, steps: Steps[Any]) -> None:
        self._steps = steps
        self.done = False
        self.value: Any = None
        self.io: IO  # set by each resume that does not end the walk
        self._resume(steps.send, None)

    def answer(self, result: Any, error: Exception | None) -> None:
        """Hand the I/O's result back to the generator, or raise its error where it yielded."""
        if error is None:
            self._resume(self._steps.send, result)
        else:
            self._resume(self._steps.throw, error)

    def _resume(self, resume: Callable[[Any], IO], arg: Any) -> None:
        try:
            self.io = resume(arg)
        except StopIteration as end:
            self.done, self.value = True, end.value


def _performed(io: IO) -> tuple[Any, Exception | None]:
    try:
        return io(), None
    except Exception as err:  # the generator decides: it handles its error or lets it rise
        return None, err


def run_blocking(steps: Steps[T]) -> T:
    """Perform the steps by calling each I/O (the sync client)."""
    walk = _Walk(steps)
    while not walk.done:
        walk.answer(*_performed(walk.io))
    return walk.value


async def _awaited(io: IO) -> tuple[Any, Exception | None]:
    try:
        return await io(), None
    except Exception as err:  # as in _performed (asyncio's cancellation is no Exception: it rises)
        return None, err


async def run_awaiting(steps: Steps[T]) -> T:
    """Perform the steps by awaiting each I/O (the asyncio client)."""
    walk = _Walk(steps)
    while not walk.done:
        walk.answer(*await _awaited(walk.io))
    return walk.value
