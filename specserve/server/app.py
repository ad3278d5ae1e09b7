"""The FastAPI application: routes of both families behind the API key check, errors in OpenAI's shape."""

from __future__ import annotations

from fastapi import Depends, FastAPI

import specserve
from specserve.server.access import ApiKeyCheck
from specserve.server.errors import install_error_handlers
from specserve.server.native_routes import native_router
from specserve.server.openai_routes import openai_router
from specserve.server.tokenizer_manager import TokenizerManager


def create_app(tm: TokenizerManager, probe_ids: list[int]) -> FastAPI:
    """probe_ids: a short valid prompt for /health_generate."""
    app = FastAPI(title="specserve", version=specserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, dependencies=[Depends(ApiKeyCheck(tm.args.api_key))])
    install_error_handlers(app, tm.metrics.observe_error)
    app.include_router(openai_router(tm))
    app.include_router(native_router(tm, probe_ids))
    return app
