"""uvicorn's h11 HTTP protocol with a header read timeout (--http-header-timeout).

uvicorn has a keep-alive timeout, but any byte that arrives resets it, and nothing bounds how long a request's
headers may take: a client trickling one byte a second holds a connection (and its buffers) for as long as it likes.
Here a connection must complete each request's headers within the timeout from the moment the server waits for them
(the connection opened, or the previous response finished); otherwise it is closed. Bodies have their own timeout,
enforced where they are read (protocol.BodyReader: a 408).

This subclasses uvicorn's public protocol class and is handed to uvicorn.Config(http=...); the h11 implementation
is the one uvicorn picks when httptools is not installed, and the one we always use, so the timeout cannot be lost
to an optional dependency.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s: float = 30.0  # set per server by with_header_timeout

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers(None)

    def on_response_complete(self) -> None:
        finished = self.cycle  # a pipelined request may start inside super(): it has a cycle of its own
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers(finished)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _await_headers(self, cycle) -> None:
        """Close the connection unless a request newer than `cycle` (None: any) has begun within the timeout: a
        request begins (gets a new cycle) once its headers are complete."""
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late, cycle)

    def _headers_late(self, cycle) -> None:
        self._header_timer = None
        if self.cycle is cycle and not self.transport.is_closing():
            logger.info("closing a connection from %s: no complete request headers within %g s "
                        "(--http-header-timeout)", self.client[0] if self.client else "?", self.header_timeout_s)
            self.transport.close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


def with_header_timeout(seconds: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...) with this header timeout."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": seconds})
