"""A `killick serve` process for the serving benchmarks, and the figures a soak watches on it.

    with ServerProcess(["--context-length", "4096"]) as server:   # demo model, a free loopback port
        server.url, server.rss_mb(), server.open_files()

Loopback only. Startup waits for the one "serving on" line (bounded); a thread then drains the server's
output (keeping the last lines and counting ERROR ones); leaving stops the process (SIGTERM, then SIGKILL
after 30 s).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str] = (), env: dict[str, str] | None = None, startup_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None
        self.log: deque[str] = deque(maxlen=200)
        self.error_lines = 0
        self.errors: deque[str] = deque(maxlen=20)  # the last ERROR lines and tracebacks' last lines
        self._drain: threading.Thread | None = None

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, cwd=REPO)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            self.log.append(line)
            if "serving on" in line:
                self._drain = threading.Thread(target=self._read_output, daemon=True)
                self._drain.start()
                return self
            if not line and self.proc.poll() is not None:
                break
        self.__exit__()
        raise RuntimeError(f"killick serve did not start: {''.join(list(self.log)[-20:])}")

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if " ERROR " in line:
                self.error_lines += 1
                self.errors.append(line.rstrip())
            elif line[:1].isalpha() and not line.startswith(("Traceback", "INFO", "WARNING", "DEBUG")):
                self.errors.append(line.rstrip())  # an exception's last line follows its ERROR line

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        if self._drain is not None:
            self._drain.join(timeout=10)
        self.proc.stdout.close()
        self.proc = None

    def rss_mb(self) -> float:
        return _status_kb(self.proc.pid, "VmRSS") / 1024

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no {key}")
