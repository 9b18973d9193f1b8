"""``vllm serve`` on loopback for the demo, the validation and the benchmarks.

- ``Server(checkpoint, *flags, log_file=...)`` starts ``vllm serve CHECKPOINT
  --host 127.0.0.1 --port <free port>`` with ``flags``, its output in
  ``log_file`` (``environment``: variables to set for it);
  ``wait()`` returns the seconds until ``/health`` answered, or raises
  ``ServerExited`` naming the log and its last error line (``last_error``) if
  the process ended first; leaving the ``with`` block stops it.
- ``TRITON_GDN_FLAGS``: the Gated DeltaNet prefill on Triton/FLA, for a side
  that forces it by name (the default is the kernel vLLM and the plugin choose).
- Every ``--additional-config`` among ``flags`` (``--additional-config JSON`` or
  ``--additional-config=JSON``) is merged into one, later keys winning
  (``merge_additional_config``): vLLM keeps only the last one given, so a
  side's ``d3_state_once`` and a forced ``d3_attention_kernel`` would not both hold.
- ``post(url, body)`` -> (HTTP status, JSON body); ``served_max_model_len(url)``
  reads ``/v1/models``.
- ``app_on_loopback(app)``: an ASGI app (vLLM's, its engine client replaced)
  behind uvicorn on a free loopback port, in a thread, for the CPU tests'
  real HTTP clients; yields its URL.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TRITON_GDN_FLAGS = ["--gdn-prefill-backend", "triton"]
ADDITIONAL_CONFIG_FLAG = "--additional-config"


def merge_additional_config(flags: list[str]) -> list[str]:
    """``flags`` with every ``--additional-config`` merged into one at the end."""
    merged: dict = {}
    rest: list[str] = []
    values = iter(flags)
    for flag in values:
        if flag == ADDITIONAL_CONFIG_FLAG:
            merged.update(json.loads(next(values)))
        elif flag.startswith(ADDITIONAL_CONFIG_FLAG + "="):
            merged.update(json.loads(flag.split("=", 1)[1]))
        else:
            rest.append(flag)
    return rest + ([ADDITIONAL_CONFIG_FLAG, json.dumps(merged)] if merged else [])


def last_error(log_file: Path) -> str:
    """The last exception line of a subprocess's log (else its last line)."""
    lines = [line.strip() for line in log_file.read_text().splitlines() if line.strip()]
    errors = [
        line for line in lines if line.split(":", 1)[0].endswith(("Error", "Exception"))
    ]
    return (errors or lines or ["(empty log)"])[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def served_max_model_len(url: str, timeout: float) -> int:
    """The ``max_model_len`` the server at ``url`` reports on ``/v1/models``."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout) as reply:
        return json.loads(reply.read())["data"][0]["max_model_len"]


class ServerExited(RuntimeError):
    """``vllm serve`` ended before it answered ``/health``."""


class Server:
    """``vllm serve CHECKPOINT`` on loopback, stopped on exit. ``wait`` returns
    the seconds until ``/health`` answered, or raises ``ServerExited`` (naming
    the log and its last error) if the process ended first."""

    def __init__(
        self,
        checkpoint: str,
        *flags: str,
        log_file: Path,
        environment: dict[str, str] | None = None,
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            checkpoint,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *merge_additional_config(list(flags)),
        ]
        with log_file.open("w") as output:
            self.process = subprocess.Popen(
                command,
                stdout=output,
                stderr=subprocess.STDOUT,
                env={**os.environ, **environment} if environment else None,
            )

    def wait(self, timeout: float = 480) -> float:
        started = time.time()
        while time.time() - started < timeout:
            if self.process.poll() is not None:
                raise ServerExited(
                    f"vllm serve exited during start-up (log: {self.log_file}): "
                    f"{last_error(self.log_file)}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return time.time() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        raise TimeoutError(f"server not up after {timeout}s; see {self.log_file}")

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


@contextmanager
def app_on_loopback(app: Any) -> Iterator[str]:
    import uvicorn

    # Without the lifespan: it would start the engine client the caller replaced.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()
