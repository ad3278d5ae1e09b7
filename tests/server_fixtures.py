"""A live `python -m specserve.launch_server` subprocess for the server tests (free port, log file, clean stop)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    url: str
    port: int
    log_path: str

    def log(self, tail: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-tail:]

    def server_info(self) -> dict:
        r = httpx.get(self.url + "/get_server_info", timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Poll until the engine runs nothing and every KV page is back; returns the last server info."""
        deadline = time.time() + timeout
        while True:
            info = self.server_info()
            idle = (info["num_running_reqs"] == 0 and info["num_queue_reqs"] == 0
                    and info["kv_free_pages"] == info["kv_initial_free_pages"] and info["num_http_requests"] == 0)
            if idle or time.time() > deadline:
                return info
            time.sleep(0.1)

    def terminate(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(args: list[str], log_path: str) -> LiveServer:
    """Start the server and wait until /health answers 200 (fails with the log tail if it exits first)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(log_path, "w")  # noqa: SIM115 (the child writes to it for its whole life)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    server = LiveServer(proc, f"http://127.0.0.1:{port}", port, log_path)
    deadline = time.time() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass  # not listening yet
        if time.time() > deadline:
            server.terminate(signal.SIGKILL)
            raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{server.log()}")
        time.sleep(0.25)
