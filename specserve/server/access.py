"""Who may call what: --api-key on every route but /health, and the owner a client's request ids belong to.

The key is compared in constant time (hmac.compare_digest over bytes), so response timing does not reveal how much
of a guessed key was right. /health stays open so a load balancer or supervisor needs no secret to probe liveness;
everything else, /metrics and the info routes included, needs the key.

Request ids: the engine only ever sees ids the server made (uuid4, unguessable). A rid a client chose is a label
scoped to its owner, the credential that sent it (a digest of its Authorization header; "" without one): another
owner cannot abort it, probe whether it is in use, or collide with it. With --api-key every holder of the key is one
owner; the server-made id of a request (meta_info.id, and the response id without a client rid) can be aborted by
anyone allowed to call /abort_request, since knowing it is the capability.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from specserve.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def owner_of(request: Request) -> str:
    """The owner of the requests this HTTP request makes: a digest of its Authorization header ("" without one)."""
    auth = request.headers.get("authorization")
    if not auth:
        return ""
    return hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32]


class ApiKeyCheck:
    """A FastAPI dependency for the whole app: with a key, a request to any path but OPEN_PATHS must carry
    "Authorization: Bearer <key>" (else 401)."""

    def __init__(self, api_key: str | None):
        self._key = None if api_key is None else api_key.encode("utf-8")

    async def __call__(self, request: Request) -> None:
        if self._key is None or request.url.path in OPEN_PATHS:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        given = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self._key):
            raise APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
