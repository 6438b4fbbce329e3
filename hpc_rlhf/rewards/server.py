"""An HTTP reward server: ``hpc-rlhf serve-reward --reward-func FILE``.

Endpoints (JSON in and out):

* ``POST /score`` with ``{"queries": [...], "prompts": [...], "labels": [...]}`` (lists of strings of one
  length; a label may be null) answers ``{"rewards": [...], "valid": [...], "extra": {...}, "errors": [...],
  "predictions": [...] or null}`` (``predictions``: the reward function's extracted answers, a string or null
  per sample; null when it returns none).  When the reward function returns reward components (a dict of named
  numbers per sample), each reward is that dict and the reward the sum of its values.
  A sample whose reward failed has ``valid`` false and reward null; ``errors`` says why.  The server never
  rejects a request because samples failed: the client decides (see :class:`~.client.RemoteReward`).
* ``GET /health`` answers ``{"ok": true}``.  It needs no token (it reveals nothing but that the server runs),
  so readiness probes can use it.

Errors: 400 bad JSON or fields, 401 missing or wrong bearer token, 404 unknown path, 411 no Content-Length,
413 body larger than ``max_request_bytes`` (refused from the Content-Length header, the body is not read),
500 the scoring itself broke (e.g. too many hung reward-function calls).

Security: the server binds 127.0.0.1 unless told otherwise.  The bearer token is read from an environment
variable (``--token-env NAME``) or a file (``--token-file PATH``), never from a command-line value, so it does
not show in ``ps``.  Requests are served concurrently (one thread per connection), so ``reward_func`` is
called from several threads at once and must be thread-safe.
"""
from __future__ import annotations

import hmac
import json
import logging
import math
import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .function import RewardFunction
from .errors import RewardError

log = logging.getLogger("hpc_rlhf.rewards")

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
DEFAULT_PORT = 5000


class _BadRequest(ValueError):
    pass


def _parse_request(body: bytes):
    try:
        req = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _BadRequest(f"body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise _BadRequest(f"body must be a JSON object with queries, prompts and labels, got {type(req).__name__}")
    fields = {}
    for name in ("queries", "prompts", "labels"):
        if name not in req:
            raise _BadRequest(f"missing field {name!r} (expected queries, prompts and labels)")
        v = req[name]
        if not isinstance(v, list):
            raise _BadRequest(f"field {name!r} must be a list of strings, got {type(v).__name__}")
        for i, x in enumerate(v):
            if not (isinstance(x, str) or (name == "labels" and x is None)):
                raise _BadRequest(f"{name}[{i}] must be a string, got {type(x).__name__}")
        fields[name] = v
    lengths = {k: len(v) for k, v in fields.items()}
    if len(set(lengths.values())) > 1:
        raise _BadRequest(f"queries, prompts and labels must have one length, got {lengths}")
    return fields["queries"], fields["prompts"], fields["labels"]


def _finite_or_none(x: float):
    x = float(x)
    return x if math.isfinite(x) else None


class _RewardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, addr, reward: RewardFunction, token: str | None, max_request_bytes: int):
        self.reward = reward
        self.token = token
        self.max_request_bytes = max_request_bytes
        super().__init__(addr, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every response carries Content-Length
    server_version = "hpc-rlhf-reward/1"
    timeout = 300  # seconds a connection may sit idle or trickle its body

    server: _RewardHTTPServer

    def log_message(self, fmt, *args):  # route access logs to logging instead of stderr
        log.debug("%s - %s", self.address_string(), fmt % args)

    def _send_json(self, code: int, obj, close: bool = False, headers: dict | None = None):
        data = json.dumps(obj, allow_nan=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, code: int, message: str, close: bool = False, headers: dict | None = None):
        self._send_json(code, {"error": message}, close=close, headers=headers)

    def _authorized(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        got = self.headers.get("Authorization", "")
        scheme, _, value = got.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json(200, {"ok": True})
        else:
            self._error(404, f"unknown path {path}: use POST /score or GET /health")

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        # Every early answer below leaves the body unread, so it closes the connection.
        if path != "/score":
            return self._error(404, f"unknown path {path}: use POST /score or GET /health", close=True)
        if not self._authorized():
            return self._error(401, "missing or wrong bearer token", close=True,
                               headers={"WWW-Authenticate": 'Bearer realm="hpc-rlhf-reward"'})
        length = self.headers.get("Content-Length")
        if length is None:
            return self._error(411, "Content-Length is required", close=True)
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            return self._error(400, f"bad Content-Length {length!r}", close=True)
        if n > self.server.max_request_bytes:
            return self._error(413, f"request body of {n} bytes exceeds the limit of "
                                    f"{self.server.max_request_bytes} bytes: send smaller batches", close=True)
        body = self.rfile.read(n)
        if len(body) != n:
            return self._error(400, f"body ended after {len(body)} of {n} bytes", close=True)
        try:
            queries, prompts, labels = _parse_request(body)
        except _BadRequest as e:
            return self._error(400, str(e))
        try:
            batch = self.server.reward.score(queries, prompts, labels)
        except (RewardError, ValueError) as e:
            log.error("scoring a request of %d samples failed: %s", len(queries), e)
            return self._error(500, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - answer instead of dropping the connection
            log.exception("scoring a request of %d samples failed", len(queries))
            return self._error(500, f"{type(e).__name__}: {e}")
        if batch.components is None:
            rewards = [_finite_or_none(r) for r in batch.rewards.tolist()]
        else:
            rewards = [dict(zip(batch.component_names, map(_finite_or_none, row))) for row in batch.components.tolist()]
        self._send_json(200, {
            "rewards": [r if v else None for r, v in zip(rewards, batch.valid.tolist())],
            "valid": batch.valid.tolist(),
            "extra": {k: _finite_or_none(v) for k, v in batch.extra.items()},
            "errors": batch.errors,
            "predictions": batch.predictions,
        })


class ServerHandle:
    """A running reward server (background thread): ``.url``, ``.host``, ``.port``, ``.stop()``."""

    def __init__(self, httpd: _RewardHTTPServer):
        self._httpd = httpd
        self.host, self.port = httpd.server_address[:2]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True, name=f"reward-server:{self.port}")
        self._thread.start()
        self._stopped = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(reward_func_path, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, batch_size: int = 64,
                 timeout_s: float | None = 60.0) -> ServerHandle:
    """Load ``reward_func_path`` and serve it on ``host:port`` (0 = a free port) in a background thread."""
    if token is not None and not token:
        raise ValueError("token is empty")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    # The server reports failed samples instead of refusing the request: the client applies its own limit.
    reward = RewardFunction(reward_func_path, batch_size=batch_size, timeout_s=timeout_s, max_failure_fraction=1.0)
    if token is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("reward server on %s has no token: anyone who can reach the port can use it "
                    "(pass --token-env or --token-file)", host)
    return ServerHandle(_RewardHTTPServer((host, port), reward, token, max_request_bytes))


def read_token(token_env: str | None = None, token_file: str | None = None) -> str | None:
    """The bearer token from the environment variable ``token_env`` or the file ``token_file`` (stripped)."""
    if token_env and token_file:
        raise ValueError("give --token-env or --token-file, not both")
    if token_env:
        token = os.environ.get(token_env, "").strip()
        if not token:
            raise ValueError(f"environment variable {token_env} (--token-env) is unset or empty")
        return token
    if token_file:
        try:
            st = os.stat(token_file)
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise ValueError(f"cannot read the token file {token_file}: {e.strerror}") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("token file %s is readable by other users: chmod 600 it", token_file)
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return None
