"""The HTTP process's handle on the model process: start it (spawn), talk to it, stop it.

Two one-way pipes. Sending never blocks the event loop: messages go to a queue that a sender thread writes into
the pipe (a full pipe, while the engine is busy in a step, only stalls that thread). A receiver thread blocks on
the other pipe and hands each message to the event loop with `call_soon_threadsafe`. When the model process dies,
the receiver gets EOF and reports it once (`on_exit`), so requests fail fast instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable

from specserve.server.messages import (
    AbortRequest,
    AddRequest,
    EngineFailed,
    EngineReady,
    FlushCache,
    Shutdown,
    StepOutput,
)
from specserve.server.model_process import run_model_process
from specserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

_STOP = object()  # sentinel for the sender thread


class EngineClient:
    def __init__(self, args: ServerArgs):
        self.args = args
        ctx = mp.get_context("spawn")
        # duplex=False: (reader, writer). The parent keeps the inbox writer and the outbox reader.
        inbox_r, self._inbox_w = ctx.Pipe(duplex=False)
        self._outbox_r, outbox_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=run_model_process, args=(args, inbox_r, outbox_w),
                                   name="specserve-engine", daemon=True)
        self.process.start()
        # Close our copies of the child's ends: otherwise EOF never arrives when the child dies.
        inbox_r.close()
        outbox_w.close()
        self._send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="engine-sender", daemon=True)
        self._receiver: threading.Thread | None = None
        self.ready = False
        self.alive = True
        self.exit_reason: str | None = None

    # ------------------------------------------------------------------ start-up
    async def wait_ready(self) -> EngineReady:
        """Block (in a thread) until the engine has loaded; raises RuntimeError when loading fails."""
        msg = await asyncio.to_thread(self._recv_first)
        if isinstance(msg, EngineFailed):
            self.alive = False
            raise RuntimeError(f"the model process failed while loading:\n{msg.message}")
        if not isinstance(msg, EngineReady):
            raise RuntimeError(f"unexpected first message from the model process: {type(msg).__name__}")
        self.ready = True
        return msg

    def _recv_first(self):
        try:
            return self._outbox_r.recv()
        except EOFError:
            self.process.join(timeout=5)
            return EngineFailed(f"the model process exited (exit code {self.process.exitcode}) before it was ready")

    def start_io(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[StepOutput], None],
                 on_exit: Callable[[str], None]) -> None:
        """Start the sender and receiver threads; callbacks run on `loop`."""
        self._sender.start()
        self._receiver = threading.Thread(target=self._recv_loop, args=(loop, on_output, on_exit),
                                          name="engine-receiver", daemon=True)
        self._receiver.start()

    # ------------------------------------------------------------------ messages
    def add(self, rid: str, input_ids: list[int], sampling: dict, return_hidden_states: bool = False,
            reasoning_end: str | None = None, return_logprob: bool = False, top_logprobs_num: int = 0,
            logprob_start_len: int = -1, images=None) -> None:
        self._send_q.put(AddRequest(rid, input_ids, sampling, return_hidden_states, reasoning_end, return_logprob,
                                    top_logprobs_num, logprob_start_len, images))

    def abort(self, rid: str) -> None:
        self._send_q.put(AbortRequest(rid))

    def flush_cache(self, flush_id: int) -> None:
        """Ask for a prefix-cache flush; the answer comes back in a StepOutput (FlushCacheResult, same id)."""
        self._send_q.put(FlushCache(flush_id))

    def _send_loop(self) -> None:
        while True:
            msg = self._send_q.get()
            if msg is _STOP:
                return
            try:
                self._inbox_w.send(msg)
            except (BrokenPipeError, OSError):
                return  # the engine is gone; the receiver reports it

    def _recv_loop(self, loop: asyncio.AbstractEventLoop, on_output, on_exit) -> None:
        while True:
            try:
                msg = self._outbox_r.recv()
            except (EOFError, OSError):
                self.process.join(timeout=5)
                reason = f"the model process exited (exit code {self.process.exitcode})"
                break
            if isinstance(msg, EngineFailed):
                reason = f"the model process failed:\n{msg.message}"
                break
            loop.call_soon_threadsafe(on_output, msg)
        self.alive = False
        self.exit_reason = self.exit_reason or reason
        if loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(on_exit, self.exit_reason)
        except RuntimeError:
            logger.debug("event loop closed before the engine exit could be reported")

    # ------------------------------------------------------------------ shutdown
    async def shutdown(self, timeout: float = 15.0) -> None:
        """Ask the engine to stop; terminate it if it does not exit within `timeout` seconds."""
        if self.process.is_alive() and not self.ready:
            # Still loading: it does not read its inbox yet, and there is nothing in flight to finish.
            self.process.terminate()
            await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():
            self.exit_reason = "shut down"
            if self._sender.is_alive():
                self._send_q.put(Shutdown())
                self._send_q.put(_STOP)
            else:
                try:
                    self._inbox_w.send(Shutdown())
                except (BrokenPipeError, OSError):
                    logger.debug("engine inbox already closed")
            await asyncio.to_thread(self.process.join, timeout)
            if self.process.is_alive():
                logger.warning("engine did not stop in %.0f s; terminating it", timeout)
                self.process.terminate()
                await asyncio.to_thread(self.process.join, 5)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join, 5)
        else:
            self._send_q.put(_STOP)
        self._inbox_w.close()
