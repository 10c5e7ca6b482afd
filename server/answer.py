"""How an API family shows a generation: the Answer it implements, and the one SSE loop every
streamed answer runs.

The request path (server/request_path.py) runs the generation, waits for it or streams it, and
handles the client leaving; an Answer only formats: its whole body, or its stream's chunks (an
opening, each event's chunks, a closing, and what a failed stream ends with). Each family (chat and
completions, Responses, Messages) writes one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any, Protocol

from server.engine_client import EngineError
from server.errors import RequestError
from server.request_types import Event

log = logging.getLogger("ppd.api")


class Answer(Protocol):
    """One generation's answer in an API family's shapes."""

    async def whole(self) -> dict[str, Any]:
        """The body of a generation that finished unstreamed."""

    def opening(self) -> Iterable[bytes]:
        """The chunks a stream starts with, before its first event's."""

    def chunks(self, event: Event) -> Iterable[bytes]:
        """An event's chunks (none: nothing to show yet, e.g. half a UTF-8 character held back)."""

    def closing(self) -> AsyncIterator[bytes]:
        """The chunks after the last event's (an async generator: the Responses API stores the
        response before its last event goes out)."""

    def error(self, status: int, message: str) -> Iterable[bytes]:
        """The chunks that end a stream that failed: the error, as the client would get it with that
        status."""


async def sse(
    answer: Answer, events: AsyncIterator[Event], first: Event | None
) -> AsyncIterator[bytes]:
    """A streamed answer's body: its opening, each event's chunks from first on, its closing; an
    error ends it early with the answer's error chunks. Closing it (the client left) closes
    events, which aborts their requests."""
    async with aclosing(events):
        try:
            for chunk in answer.opening():
                yield chunk
            event = first
            while event is not None:
                for chunk in answer.chunks(event):
                    yield chunk
                event = await anext(events, None)
            async for chunk in answer.closing():
                yield chunk
        except (EngineError, RequestError) as exc:
            for chunk in answer.error(exc.status, exc.message):
                yield chunk
        except (
            Exception
        ) as exc:  # a bug of ours: the client still gets an error event, the log the rest
            log.error("a stream failed", exc_info=exc)
            for chunk in answer.error(
                500, f"internal error ({type(exc).__name__}); the server logged it"
            ):
                yield chunk
