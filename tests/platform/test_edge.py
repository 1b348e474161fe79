"""The HTTP edge of `modelyard serve`, against a real server process: no work before
authentication (a stranger's upload is refused before its body is read), nothing told to
strangers (`/health`, `/metrics`), 413 for every body over the limit however it is framed, and
the data directory private on disk (also for an install made before, fixed at start)."""

from __future__ import annotations

import contextlib
import http.client
import select
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.platform_harness import PlatformProcess, create_key, create_tenant

MAX_BODY = 64 * 1024
METRICS_TOKEN = "scrape-token-for-tests"
UPLOAD = 40 * 10**6  # the 40 MB upload of the issue


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_MAX_BODY_BYTES": str(MAX_BODY),
        "MODELYARD_METRICS_TOKEN": METRICS_TOKEN,
    }
    p = PlatformProcess(tmp_path_factory.mktemp("edge"), env).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> httpx.Client:
    return platform.api()


@pytest.fixture(scope="module")
def tenant_keys(admin: httpx.Client) -> dict[str, str]:
    """A tenant's inference-only key and its admin-only key."""
    tenant_id = create_tenant(admin, f"edge-{time.time_ns()}")
    return {
        "inference": create_key(admin, tenant_id, scopes=["inference"])["key"],
        "admin": create_key(admin, tenant_id, scopes=["admin"])["key"],
    }


_PREAMBLE = b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
_EPILOGUE = (
    b'\r\n--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--xyz--\r\n'
)


def _upload(port: int, key: str, size: int) -> tuple[int, int]:
    """A well-formed multipart upload of a `size`-byte file to /v1/files, sent until the server
    answers: (status, file bytes sent by then). A server that reads the body before refusing
    answers only once all of it is sent."""
    length = len(_PREAMBLE) + size + len(_EPILOGUE)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: multipart/form-data; boundary=xyz\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        sock.sendall(head + _PREAMBLE)
        sent = 0
        chunk = (b"x" * 1023 + b"\n") * 64  # 64 KiB of 1 KiB lines (a batch line is bounded)
        sock.setblocking(False)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([sock], [sock] if sent < size else [], [], 1)
            if readable:
                break
            if writable:
                with contextlib.suppress(BlockingIOError):
                    sent += sock.send(chunk[: size - sent])
                if sent == size:
                    sock.setblocking(True)
                    sock.sendall(_EPILOGUE)
                    sock.setblocking(False)
        sock.setblocking(True)
        sock.settimeout(30)
        data = b""
        while b"\r\n" not in data:
            part = sock.recv(4096)
            if not part:
                break
            data += part
    assert data.startswith(b"HTTP/1.1 "), data
    return int(data.split(b" ")[1]), sent


def test_a_strangers_upload_is_refused_before_its_body_is_read(platform: PlatformProcess) -> None:
    status, sent = _upload(platform.port, "sk-my-not-a-real-key", UPLOAD)
    assert status == 401
    # Answered while most of the body was still unsent: the server never read it.
    assert sent < UPLOAD // 4, f"{sent} of {UPLOAD} bytes were sent before the 401"


def test_a_key_without_the_scope_is_refused_before_the_body_is_read(
    platform: PlatformProcess, tenant_keys: dict[str, str]
) -> None:
    status, sent = _upload(platform.port, tenant_keys["admin"], UPLOAD)
    assert status == 403
    assert sent < UPLOAD // 4, f"{sent} of {UPLOAD} bytes were sent before the 403"


def test_a_good_keys_upload_is_read_whole(
    platform: PlatformProcess, tenant_keys: dict[str, str]
) -> None:
    """The control for the two above: the same upload with the right key is read and stored."""
    status, sent = _upload(platform.port, tenant_keys["inference"], 2 * 10**6)
    assert (status, sent) == (200, 2 * 10**6)


def test_health_tells_strangers_only_the_status(
    platform: PlatformProcess, admin: httpx.Client, tenant_keys: dict[str, str]
) -> None:
    assert httpx.get(f"{platform.url}/health").json() == {"status": "ok"}
    tenant = platform.api(tenant_keys["admin"])
    assert tenant.get("/health").json() == {"status": "ok"}
    bad = httpx.get(f"{platform.url}/health", headers={"authorization": "Bearer sk-my-nope"})
    assert bad.status_code == 200 and bad.json() == {"status": "ok"}
    details = admin.get("/health").json()
    assert details["status"] == "ok" and "endpoints" in details


def test_an_idle_keep_alive_connection_outlives_a_client_pools_expiry(
    platform: PlatformProcess,
) -> None:
    """A connection idle past httpx's (and the openai SDK's) 5 s pool expiry is still open, so
    a pool never reuses one the server is closing in that instant (a read error, no answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", platform.port, timeout=5)
    try:
        conn.request("GET", "/health")
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read()
        sock = conn.sock
        # The passage of idle time is what is tested (no state to wait on): past the pools'
        # 5 s expiry, which is also uvicorn's default keep-alive.
        time.sleep(5.5)
        # Still open: a connection the server closed reads as ready (end of file) at once.
        assert sock is not None
        ready, _, _ = select.select([sock], [], [], 0)
        assert not ready, "the server closed the idle connection"
        conn.request("GET", "/health")  # and it serves on that same connection
        answer = conn.getresponse()
        assert answer.status == 200 and answer.read() and conn.sock is sock
    finally:
        conn.close()


def test_metrics_need_the_platform_admin_or_the_scrape_token(
    platform: PlatformProcess, admin: httpx.Client, tenant_keys: dict[str, str]
) -> None:
    r = httpx.get(f"{platform.url}/metrics")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert platform.api(tenant_keys["admin"]).get("/metrics").status_code == 403
    wrong = httpx.get(f"{platform.url}/metrics", headers={"authorization": "Bearer scrape-tok"})
    assert wrong.status_code == 401
    assert admin.get("/metrics").status_code == 200
    scraped = httpx.get(
        f"{platform.url}/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}
    )
    assert scraped.status_code == 200
    assert "modelyard" in scraped.text


def _chunks(total: int) -> Iterator[bytes]:
    yield b'{"name": "'
    sent = 0
    while sent < total:
        yield b"x" * 4096
        sent += 4096
    yield b'"}'


@pytest.mark.parametrize("path", ["/v1/tenants", "/v1/keys", "/v1/batches", "/v1/chat/completions"])
def test_a_chunked_body_over_the_limit_is_413(admin: httpx.Client, path: str) -> None:
    # A generator body is sent chunked (no Content-Length), so only the streamed count can stop it.
    r = admin.post(
        path, content=_chunks(2 * MAX_BODY), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _blobs(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / "artifacts" / "blobs").rglob("*") if p.is_file()]


def test_the_data_dir_is_private_and_is_made_so_at_start(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    p = PlatformProcess(data_dir).start()
    try:
        r = p.openai().files.create(file=("a.jsonl", b'{"a": 1}\n'), purpose="batch")
        assert r.id
    finally:
        p.stop()
    assert _mode(data_dir) == 0o700
    assert _mode(data_dir / "modelyard.db") == 0o600
    assert _mode(data_dir / "admin_key") == 0o600
    blobs = _blobs(data_dir)
    assert blobs and all(_mode(b) == 0o400 for b in blobs)

    # An install made before: world-readable everything. The next start makes it private.
    data_dir.chmod(0o755)
    (data_dir / "modelyard.db").chmod(0o644)
    (data_dir / "admin_key").chmod(0o644)
    for b in blobs:
        b.chmod(0o444)
    p = PlatformProcess(data_dir).start()
    p.stop()
    assert _mode(data_dir) == 0o700
    assert _mode(data_dir / "modelyard.db") == 0o600
    assert _mode(data_dir / "admin_key") == 0o600
    assert all(_mode(b) == 0o400 for b in blobs)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/tenants", b'{"name": "nul\\u0000here"}', "name"),
        ("/v1/tenants", b'{"name": "lone \\udcff surrogate"}', "name"),
        ("/v1/keys", b'{"name": "k", "scopes": ["inference\\u0000"]}', "scopes[0]"),
    ],
)
def test_text_that_cannot_be_stored_is_a_400_naming_the_field(
    admin: httpx.Client, path: str, body: bytes, param: str
) -> None:
    r = admin.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "invalid_text"


@pytest.mark.parametrize(
    ("url", "param"),
    [
        ("/v1/users?tenant_id=%00x", "tenant_id"),  # PostgreSQL refused the comparison: a 500
        ("/v1/keys?after=a&tenant_id=tn%00", "tenant_id"),
        ("/v1/budgets/bdg-%00", "path"),
        ("/v1/models/tiny%00", "path"),
    ],
)
def test_a_nul_in_a_url_is_a_400_naming_where(admin: httpx.Client, url: str, param: str) -> None:
    r = admin.get(url)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "invalid_text"


def test_a_nul_in_an_oip_url_is_a_400_in_the_protocols_shape(admin: httpx.Client) -> None:
    r = admin.post("/v2/models/tiny/infer?version=K%00w", json={"inputs": []})
    assert r.status_code == 400, r.text
    assert isinstance(r.json()["error"], str) and "'version'" in r.json()["error"]
