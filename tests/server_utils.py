"""Start and stop a loopback `vllm serve` for tests.

The server runs as a subprocess in its own process group (the API server spawns an
engine-core process and a worker), listens on 127.0.0.1 on a free port and logs to a
temporary file whose tail is attached to every failure.  `stop()` sends SIGTERM and
requires the whole group to be gone within a bound; anything left over is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

VLLM = str(Path(sys.executable).with_name("vllm"))

SMALL_SETTINGS = (
    "--max-model-len", "256",
    "--kv-cache-memory-bytes", str(64 << 20),
    "--gpu-memory-utilization", "0.3",
    "--dtype", "float32",
    "--max-num-seqs", "8",
    "--enforce-eager",
    "--seed", "0",
)

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a zombie-only group on some kernels
        return True
    return True


class ServerProcess:
    """One `vllm serve MODEL` subprocess on 127.0.0.1."""

    def __init__(self, model: str, *extra_args: str, env: dict[str, str] | None = None):
        self.model = model
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.args = [
            VLLM, "serve", model,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *SMALL_SETTINGS,
            *extra_args,
        ]
        self.env = {
            # A server runs as users run it: the engine core in its own process.
            **{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.exit_seconds: float | None = None

    # ---- logs -----------------------------------------------------------------

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as err:
            return f"<no server log: {err}>"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def fail(self, message: str) -> None:
        raise AssertionError(f"{message}\n--- server log tail ({self.log_path}) ---\n{self.log_tail()}")

    # ---- lifecycle ------------------------------------------------------------

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: one signal reaches all
            )
        finally:
            log.close()
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.kill()  # never leave a half-started server behind
            raise
        return self.base_url

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    self.fail(f"vllm serve exited with code {code} before becoming healthy")
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        self.fail(f"vllm serve did not answer GET /health within {timeout:.0f} s")

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=10.0).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> float:
        """SIGTERM; assert the server and its children exit within `timeout` s.

        Returns the seconds the main process took to exit.  Idempotent."""
        if self.proc is None:
            return 0.0
        if self.exit_seconds is not None:
            return self.exit_seconds
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        started = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.fail(f"vllm serve did not exit within {timeout:.0f} s of SIGTERM")
        self.exit_seconds = time.monotonic() - started
        # Children (engine core, worker) must not outlive the server for long.
        deadline = started + timeout
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            self.kill()
            self.fail(f"processes of vllm serve's group {pgid} outlived it by {timeout:.0f} s")
        self.log_path.unlink(missing_ok=True)  # a clean stop leaves nothing behind
        return self.exit_seconds

    def kill(self) -> None:
        """SIGKILL the whole process group (the server and its children)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if self.exit_seconds is None:
            self.exit_seconds = float("inf")

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.kill()
        else:
            self.stop()
