"""`specserve serve`: parse the SGLang-style flags, start the model process, warm up, serve HTTP, shut down cleanly.

Order of start-up: bind the port (fail fast when it is taken, before a long model load), spawn the model process
and load the tokenizer here at the same time, wait until both are ready, run one warm-up generation through the
whole path (unless --skip-warmup), then start uvicorn on the bound socket and log "ready" with the address.
Clients see "connection refused" until then, never a half-ready server.

Shutdown (SIGINT / SIGTERM): uvicorn stops accepting; in-flight requests are aborted at once (streams end with
finish_reason "abort"), so the graceful wait is short; then the model process is told to stop (terminated if it
does not), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import uvicorn

import specserve
from specserve.defaults import embedded_chat_template_path, embedded_model_path, is_embedded
from specserve.server.errors import APIError
from specserve.server.http_protocol import with_header_timeout
from specserve.server.tokenizer_manager import EMBEDDED_SERVED_NAME, GenRequest, TokenizerManager
from specserve.server_args import CommandParser, ServerArgs

logger = logging.getLogger("specserve.server")

WARMUP_PROMPT = "The capital of France is"
WARMUP_TOKENS = 8
GRACEFUL_SHUTDOWN_S = 30
ENGINE_LOST_GRACE_S = 10.0  # 503s after the engine died, then exit 1


class _Stopped(Exception):
    """A shutdown signal arrived while waiting."""


class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal aborts in-flight requests so the graceful wait does not wait
    for long generations to finish."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def served_model_name(args: ServerArgs, model_path: str) -> str:
    if args.served_model_name:
        return args.served_model_name
    if is_embedded(args.model_path):
        return EMBEDDED_SERVED_NAME
    base = os.path.basename(os.path.normpath(model_path))
    return base[:-len(".gguf")] if base.endswith(".gguf") else base


def chat_template_of(args: ServerArgs) -> str | None:
    """--chat-template, else for the embedded model specserve's ChatML template that renders tools (its own does
    not), else None (the tokenizer's own template)."""
    if args.chat_template is None and args.model_path is None:
        return embedded_chat_template_path()
    return args.chat_template


def build_parser() -> CommandParser:
    """`specserve serve`'s flags (docs/flags.md is generated from this parser: scripts/gen_flags_doc.py)."""
    p = CommandParser(prog="specserve serve", allow_abbrev=False,
                      description="OpenAI-compatible and SGLang-native HTTP server (SGLang flag names).")
    ServerArgs.add_cli_args(p)
    return p


def parse_args(argv: list[str] | None) -> ServerArgs:
    """ServerArgs from the command line; unknown flags and invalid values exit with code 2 and a clear message."""
    p = build_parser()
    ns, unknown = p.parse_known_args(argv)
    if unknown:
        p.error(f"unrecognized or unsupported argument(s): {' '.join(unknown)}")
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        p.error(str(e))
    raise AssertionError("unreachable: argparse's error() exits")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="[%(asctime)s %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    if args.tp_size > 1:
        from specserve.defaults import embedded_draft_path
        from specserve.engine.engine import resolve_device
        from specserve.engine.tp_ranks import exit_follower, run_follower, run_node, torchrun_env

        launched = torchrun_env()
        if launched is not None and launched[0] > 0:  # torchrun's rank k > 0: follow rank 0 (which serves)
            rank, local_rank, world = launched
            device = resolve_device(args.device)
            resolved = args.with_embedded_defaults(embedded_draft_path(), device.type)  # as rank 0's engine
            exit_follower(lambda: run_follower(rank, local_rank, world, "env://", device.type, resolved))
        if args.node_rank > 0:  # another machine of a multi-node engine: only its tensor-parallel ranks
            return run_node(args, resolve_device(args.device))
    return asyncio.run(serve(args))


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def _until(work, stop: asyncio.Event):
    """Await `work` unless `stop` is set first (then raise _Stopped)."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _Stopped()
    return task.result()


def _probe_ids(tokenizer, vocab_size: int) -> list[int]:
    """A short valid prompt for warm-up and /health_generate."""
    ids = [t for t in tokenizer.encode(WARMUP_PROMPT) if 0 <= t < vocab_size]
    return ids or [min(1, vocab_size - 1)]


async def _warmup(tm: TokenizerManager, probe: list[int]) -> None:
    t0 = time.perf_counter()
    logger.info("warm-up: generating %d tokens through the whole path...", WARMUP_TOKENS)
    last = await tm.generate_one(GenRequest(probe, {"max_new_tokens": WARMUP_TOKENS, "temperature": 0.0,
                                                    "ignore_eos": True}, internal=True))
    logger.info("warm-up done in %.2f s (%d tokens)", time.perf_counter() - t0, last.meta["completion_tokens"])


async def _announce_when_started(server: uvicorn.Server, args: ServerArgs, name: str) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("specserve ready: serving %r at http://%s:%d (OpenAI API under /v1)", name, host, args.port)


async def _exit_when_engine_lost(tm: TokenizerManager, stop: asyncio.Event, lost: list[bool]) -> None:
    """An engine that died on its own takes the server down (exit code 1) after ENGINE_LOST_GRACE_S, during which
    every request, /health included, gets a 503: a supervisor or load balancer sees it and restarts us, rather than
    an HTTP process answering 503 forever."""
    await tm.engine_lost.wait()
    logger.error("the engine process is gone; the server exits in %.0f s", ENGINE_LOST_GRACE_S)
    await asyncio.sleep(ENGINE_LOST_GRACE_S)
    lost.append(True)
    stop.set()


async def _stop_on_signal(stop: asyncio.Event, server: uvicorn.Server, tm: TokenizerManager) -> None:
    # Covers a signal that lands just before uvicorn installs its own handlers.
    await stop.wait()
    tm.abort_all("the server is shutting down")
    server.should_exit = True


async def serve(args: ServerArgs) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum, _frame) -> None:
        loop.call_soon_threadsafe(stop.set)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return await _serve(args, stop, loop)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


async def _serve(args: ServerArgs, stop: asyncio.Event, loop: asyncio.AbstractEventLoop) -> int:
    from specserve.models.loader import ModelSource
    from specserve.server.app import create_app
    from specserve.server.engine_client import EngineClient
    from specserve.server.metrics import ServerMetrics
    from specserve.tokenizer import load_tokenizer

    try:
        model_path = args.model_path or embedded_model_path()
        src = ModelSource.resolve(model_path)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, e)
        return 1
    logger.info("specserve %s: loading %s (tokenizer here, model in the engine process)", specserve.__version__,
                model_path)
    engine = EngineClient(args)
    try:
        t0 = time.perf_counter()
        try:
            tokenizer, ready = await _until(asyncio.gather(
                asyncio.to_thread(load_tokenizer, src, args.tokenizer_path, chat_template_of(args)),
                engine.wait_ready()), stop)
        except _Stopped:
            logger.info("interrupted while loading")
            return 0
        except (RuntimeError, ValueError, OSError) as e:
            logger.error("start-up failed: %s", e)
            return 1
        info = ready.info
        logger.info("engine ready in %.1f s (pid %d): %s, context %d, KV %d tokens, max running %d%s",
                    time.perf_counter() - t0, info.pid, info.architecture, info.context_len, info.max_total_tokens,
                    info.max_running, f", {info.spec_algorithm} N={info.spec_num_steps} (draft "
                    f"{info.draft_model_path or 'in the target checkpoint'}"
                    f"{', context lookup' if info.spec_ngram_lookup else ''}"
                    f"{', int8 draft' if info.draft_quantization == 'int8' else ''})" if info.spec_enabled else "")
        name = served_model_name(args, model_path)
        tm = TokenizerManager(args, tokenizer, engine, info, name, ServerMetrics(name))
        tm.attach(loop)
        probe = _probe_ids(tokenizer, info.vocab_size)
        if not args.skip_warmup:
            try:
                await _until(_warmup(tm, probe), stop)
            except _Stopped:
                logger.info("interrupted during warm-up")
                return 0
            except APIError as e:
                logger.error("warm-up failed: %s", e.message)
                return 1
        config = uvicorn.Config(create_app(tm, probe), log_level=args.log_level, log_config=None,
                                access_log=args.log_level == "debug", lifespan="off",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                                http=with_header_timeout(args.http_header_timeout))
        server = _Server(config, on_exit=lambda: loop.call_soon_threadsafe(tm.abort_all,
                                                                           "the server is shutting down"))
        lost: list[bool] = []
        helpers = [asyncio.create_task(_announce_when_started(server, args, name)),
                   asyncio.create_task(_stop_on_signal(stop, server, tm)),
                   asyncio.create_task(_exit_when_engine_lost(tm, stop, lost))]
        try:
            await server.serve(sockets=[sock])
        finally:
            for h in helpers:
                h.cancel()
        logger.info("HTTP server stopped; stopping the engine")
        return 1 if lost else 0
    finally:
        await engine.shutdown()
        sock.close()
        logger.info("shut down")
