"""Reward server (HTTP) and RemoteReward client: round trip, auth, limits, spreading, retries, concurrency."""
import argparse
import http.client
import json
import logging
import socket
import threading
import time

import pytest

from hpc_rlhf.rewards.client import RemoteReward
from hpc_rlhf.rewards.errors import RewardError
from hpc_rlhf.rewards.server import start_server
from hpc_rlhf.entrypoints.tools import add_serve_reward_args, serve_reward
from hpc_rlhf.rewards.server import read_token

REWARD_FILE = '''
import time

DELAY = {delay}

def reward_func(queries, prompts, labels):
    if DELAY:
        time.sleep(DELAY)
    if "bad" in labels:
        raise RuntimeError("cannot score label bad")
    return {{"rewards": [float(len(q)) for q in queries], "extra_logs": {{"len": [len(q) for q in queries]}}}}
'''


def _write(tmp_path_factory, delay=0.0):
    p = tmp_path_factory.mktemp("rf") / "reward.py"
    p.write_text(REWARD_FILE.format(delay=delay))
    return p


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    return _write(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(reward_file):
    handles = [start_server(reward_file, port=0, batch_size=4) for _ in range(2)]
    yield handles
    for h in handles:
        h.stop()


@pytest.fixture(scope="module")
def token_server(reward_file):
    h = start_server(reward_file, port=0, token="s3cret-token", max_request_bytes=300)
    yield h
    h.stop()


def _request(handle, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection(handle.host, handle.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _dead_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connections are refused
    return f"http://127.0.0.1:{port}"


def _samples(n, bad=()):
    queries = ["x" * (i + 1) for i in range(n)]
    return queries, ["p"] * n, ["bad" if i in bad else "ok" for i in range(n)]


# -- server ------------------------------------------------------------------------------------------------

def test_health_and_score_round_trip(servers):
    h = servers[0]
    assert h.url == f"http://127.0.0.1:{h.port}" and h.port > 0
    assert _request(h, "GET", "/health") == (200, {"ok": True})
    body = json.dumps({"queries": ["a", "bbb"], "prompts": ["p", "p"], "labels": ["l", None]})
    status, ans = _request(h, "POST", "/score", body, {"Content-Type": "application/json"})
    assert status == 200
    assert ans["rewards"] == [1.0, 3.0] and ans["valid"] == [True, True] and ans["errors"] == []
    assert ans["extra"]["reward/len"] == 2.0 and ans["extra"]["reward/func/failures"] == 0
    # a failing reward function gives invalid samples (null rewards) with the reason, not an HTTP error; the
    # server narrows the failure down to the sample it fails on
    body = json.dumps({"queries": ["a", "b"], "prompts": ["p", "p"], "labels": ["bad", "ok"]})
    status, ans = _request(h, "POST", "/score", body)
    assert status == 200 and ans["valid"] == [False, True] and ans["rewards"] == [None, 1.0]
    assert "sample 0 raised RuntimeError: cannot score label bad" in ans["errors"][0]


def test_binds_loopback_by_default(servers):
    for h in servers:
        assert h.host == "127.0.0.1"
        assert h._httpd.socket.getsockname()[0] == "127.0.0.1"


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (json.dumps({"queries": ["a"], "prompts": ["p"]}).encode(), "missing field 'labels'"),
    (json.dumps({"queries": ["a"], "prompts": ["p"], "labels": ["l", "m"]}).encode(), "one length"),
    (json.dumps({"queries": [1], "prompts": ["p"], "labels": ["l"]}).encode(), "queries[0] must be a string"),
])
def test_bad_requests_are_400(servers, body, message):
    status, ans = _request(servers[0], "POST", "/score", body)
    assert status == 400 and message in ans["error"]


def test_unknown_path_is_404(servers):
    assert _request(servers[0], "GET", "/nope")[0] == 404
    assert _request(servers[0], "POST", "/nope", b"{}")[0] == 404


def test_token_required(token_server):
    body = json.dumps({"queries": ["ab"], "prompts": ["p"], "labels": ["l"]})
    assert _request(token_server, "POST", "/score", body)[0] == 401
    assert _request(token_server, "POST", "/score", body, {"Authorization": "Bearer wrong"})[0] == 401
    assert _request(token_server, "POST", "/score", body, {"Authorization": "s3cret-token"})[0] == 401
    status, ans = _request(token_server, "POST", "/score", body, {"Authorization": "Bearer s3cret-token"})
    assert status == 200 and ans["rewards"] == [2.0]
    assert _request(token_server, "GET", "/health")[0] == 200  # readiness probes need no token


def test_oversize_body_is_413_without_reading_it(token_server):
    conn = http.client.HTTPConnection(token_server.host, token_server.port, timeout=5)
    try:
        conn.putrequest("POST", "/score")
        conn.putheader("Authorization", "Bearer s3cret-token")
        conn.putheader("Content-Length", str(50_000_000))
        conn.endheaders()  # no body sent at all: a server that tried to read it would hang until timeout
        resp = conn.getresponse()
        assert resp.status == 413
        assert "exceeds the limit of 300 bytes" in json.loads(resp.read())["error"]
    finally:
        conn.close()


def test_cli_token_from_env_or_file(reward_file, tmp_path, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    add_serve_reward_args(parser)
    with pytest.raises(SystemExit):  # the token is never a command-line value
        parser.parse_args(["--reward-func", str(reward_file), "--token", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--reward-func", "f.py", "--token-env", "A", "--token-file", "B"])
    tok = tmp_path / "tok"
    tok.write_text("file-token\n")
    assert read_token(token_file=str(tok)) == "file-token"
    with pytest.raises(ValueError, match="unset or empty"):
        read_token(token_env="HPC_RLHF_TEST_UNSET_TOKEN")

    monkeypatch.setenv("HPC_RLHF_TEST_TOKEN", "env-token")
    args = parser.parse_args(["--reward-func", str(reward_file), "--port", "0", "--token-env", "HPC_RLHF_TEST_TOKEN"])
    stop = threading.Event()
    rc = []
    t = threading.Thread(target=lambda: rc.append(serve_reward(args, stop_event=stop)))
    t.start()
    try:
        url, out = None, ""
        for _ in range(100):
            out += capsys.readouterr().out
            if " at http://" in out:
                url = out.split(" at ", 1)[1].split()[0]
                break
            time.sleep(0.05)
        assert url and url.startswith("http://127.0.0.1:")
        assert RemoteReward([url], token="env-token").score(["abc"], ["p"], ["l"]).rewards.tolist() == [3.0]
        with pytest.raises(RewardError, match="HTTP 401"):
            RemoteReward([url], token="wrong").score(["abc"], ["p"], ["l"])
    finally:
        stop.set()
        t.join(10)
    assert rc == [0]
    bad = parser.parse_args(["--reward-func", str(tmp_path / "missing.py"), "--port", "0"])
    assert serve_reward(bad) == 2


# -- client ------------------------------------------------------------------------------------------------

def test_client_spreads_batches_over_servers(servers):
    client = RemoteReward([h.url for h in servers], batch_size=2, backoff_s=0.01)
    out = client.score(*_samples(8))
    assert out.rewards.tolist() == [float(i + 1) for i in range(8)] and out.valid.all()
    assert out.extra["reward/remote/requests/0"] == 2 and out.extra["reward/remote/requests/1"] == 2
    assert out.extra["reward/remote/failures"] == 0 and out.extra["reward/func/failures"] == 0
    assert out.extra["reward/len"] == pytest.approx(4.5)
    # single-batch calls alternate between the servers
    for _ in range(4):
        client.score(*_samples(1))
    assert client.total_requests == [4, 4]


def test_client_survives_a_dead_url(servers):
    client = RemoteReward([_dead_url(), servers[0].url], batch_size=2, retries=2, backoff_s=0.01)
    out = client.score(*_samples(6))
    assert out.valid.all() and out.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert out.extra["reward/remote/requests/0"] >= 1  # some batches started on the dead URL ...
    assert out.extra["reward/remote/retries"] == out.extra["reward/remote/requests/0"]  # ... and moved on


def test_client_all_dead_marks_invalid_and_counts(caplog):
    dead = [_dead_url(), _dead_url()]
    caplog.set_level(logging.ERROR, logger="hpc_rlhf.rewards")
    client = RemoteReward(dead, batch_size=2, retries=2, backoff_s=0.01, max_failure_fraction=1.0)
    out = client.score(*_samples(4))
    assert not out.valid.any() and out.rewards.isnan().all()
    assert out.extra["reward/remote/failures"] == 4 and out.extra["reward/remote/failed_batches"] == 2
    assert out.extra["reward/remote/requests/0"] + out.extra["reward/remote/requests/1"] == 6  # 3 tries each
    assert dead[0] in caplog.text and dead[1] in caplog.text and "connection failed" in caplog.text
    with pytest.raises(RewardError, match="4 of 4 remote reward samples failed"):
        RemoteReward(dead, batch_size=2, retries=1, backoff_s=0.01).score(*_samples(4))


def test_client_counts_samples_the_server_could_not_score(servers):
    client = RemoteReward([servers[1].url], batch_size=2, max_failure_fraction=1.0)
    out = client.score(*_samples(4, bad={3}))
    assert out.valid.tolist() == [True, True, True, False]
    assert out.extra["reward/remote/failures"] == 1 and out.extra["reward/func/failures"] == 1
    assert out.extra["reward/remote/retries"] == 0  # a failing reward function is not retried
    assert "cannot score label bad" in out.errors[0]


def test_client_batches_run_concurrently(tmp_path_factory):
    delay = 0.4
    h = start_server(_write(tmp_path_factory, delay=delay), port=0, batch_size=1)
    try:
        client = RemoteReward([h.url], batch_size=1)
        t0 = time.monotonic()
        out = client.score(*_samples(4))
        elapsed = time.monotonic() - t0
    finally:
        h.stop()
    assert out.valid.all()
    assert elapsed < 0.6 * 4 * delay, f"4 batches of {delay} s took {elapsed:.2f} s: they did not overlap"
