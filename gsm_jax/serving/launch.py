"""Start `gsm-jax serve` in a subprocess on a free loopback port and wait until it is healthy:
what the serving benchmark, the evidence report and the tests use to measure the
real server (HTTP, SSE, its own process) rather than the engine in-process.

    with ServerProcess(["--model", "smollm2-135m", "--max-batch", "16"]) as srv:
        httpx.get(f"{srv.url}/v1/models")
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ServerProcess", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`gsm-jax serve <args>` on 127.0.0.1:<free port>; `url`, `admin_token`, `log_path`.

    `start()` waits up to `timeout` s for `/health` to answer 200 (it answers 503 while
    the model loads and compiles) and raises with the log's tail if the process dies;
    `start(wait=False)` returns once the process is started (`health()` then tells how far
    it got: "loading", "warming" with its "warming n/N", "ready").
    `cpus`: the cores the server may run on (set before JAX starts its threads).
    `stop()` sends SIGTERM (the server drains) and waits; `kill()` does not wait.
    """

    def __init__(self, args: Sequence[str], *, log_path: str | os.PathLike | None = None,
                 admin_token: str | None = None, timeout: float = 900.0,
                 env: dict[str, str] | None = None, cpus: set[int] | None = None) -> None:
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_token = admin_token
        self.timeout = float(timeout)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = {**os.environ, **(env or {})}
        self.cpus = None if cpus is None else set(cpus)  # pin the server (Linux affinity)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    def _log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-n:]

    def health(self) -> tuple[int, dict[str, Any], dict[str, str]] | None:
        """`/health` now: (status code, JSON body, headers); None if it does not answer."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/health", timeout=2)
        except httpx.TransportError:
            return None
        return r.status_code, r.json(), dict(r.headers)

    def start(self, wait: bool = True) -> ServerProcess:
        import httpx

        cmd = [sys.executable, "-c", "import sys; from gsm_jax.cli import main; sys.exit(main())",
               "serve", "--port", str(self.port), *self.args]
        if self.admin_token:
            cmd += ["--admin-token", self.admin_token]
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "w")  # noqa: SIM115 - owned by the child
        t0 = time.time()
        pin = None if self.cpus is None else (lambda: os.sched_setaffinity(0, self.cpus))
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=pin)
        if not wait:
            return self
        while time.time() - t0 < self.timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gsm-jax serve exited with {self.proc.returncode}: "
                                   f"{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.startup_s = time.time() - t0
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"gsm-jax serve was not healthy after {self.timeout:.0f} s: "
                           f"{self._log_tail()}")

    def stop(self, timeout: float = 120.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
