"""`redis_url` as the platform reads it: one server's URL passes through to redis-py, a
`redis+sentinel://` URL is split into its Sentinels, service name and database, and anything
else stops `modelyard serve` at startup with a one-line error naming what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from modelyard.core.redis_url import RedisUrlError, SentinelTarget, parse_redis_url


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/3", "rediss://u:p@cache:6380", "unix:///tmp/redis.sock"]
)
def test_one_server_urls_pass_through(url: str) -> None:
    assert parse_redis_url(url) == url


def test_sentinel_urls() -> None:
    assert parse_redis_url("redis+sentinel://10.0.0.1:26379,s2:26380,[::1]:5000/mymaster/2") == (
        SentinelTarget((("10.0.0.1", 26379), ("s2", 26380), ("::1", 5000)), "mymaster", 2)
    )
    # The port defaults to Sentinel's; the database to 0; a password is the primary's.
    assert parse_redis_url("redis+sentinel://:s%40cret@sentinel/svc") == SentinelTarget(
        (("sentinel", 26379),), "svc", 0, None, "s@cret"
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("localhost:6379", "no scheme"),
        ("http://h:1/x", "is not one of"),
        ("redis+sentinel://h:26379", "no SERVICE_NAME"),
        ("redis+sentinel://h:26379/", "no SERVICE_NAME"),
        ("redis+sentinel://h:26379/my svc", "SERVICE_NAME"),
        ("redis+sentinel://h:26379/svc/x", "DB"),
        ("redis+sentinel://h:26379/svc/99999999", "DB"),
        ("redis+sentinel://h:0/svc", "port 0"),
        ("redis+sentinel://h:70000/svc", "port 70000"),
        ("redis+sentinel://h:1,,h2:2/svc", "is not HOST:PORT"),
        ("redis+sentinel://h:port/svc", "is not HOST:PORT"),
        ("redis+sentinel://h:1/svc?ssl=true", "query"),
        ("redis+sentinel://" + ",".join(f"h{i}:1" for i in range(17)) + "/svc", "over 16"),
        ("redis+sentinel://h:1/" + "s" * 3000, "characters long"),
    ],
)
def test_bad_urls_are_refused_with_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match="redis_url") as refused:
        parse_redis_url(url)
    assert says in str(refused.value)


def test_a_password_is_not_repeated_in_the_error() -> None:
    with pytest.raises(RedisUrlError) as refused:
        parse_redis_url("redis+sentinel://user:hunter2@h:1/bad name")
    assert "hunter2" not in str(refused.value)


def test_serve_stops_at_startup_on_a_bad_url(tmp_path: os.PathLike[str]) -> None:
    env = {**os.environ, "MODELYARD_REDIS_URL": "redis+sentinel://h:26379"}
    out = subprocess.run(
        [sys.executable, "-m", "modelyard.cli", "serve", "--data-dir", str(tmp_path),
         "--no-default-models", "--port", "1"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: redis_url 'redis+sentinel://h:26379': no SERVICE_NAME" in out.stderr
    assert "Traceback" not in out.stderr
