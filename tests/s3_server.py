"""An S3-compatible server for tests (moto's ThreadedMotoServer on 127.0.0.1, a free port, one per session)
and a fault-injecting HTTP proxy on 127.0.0.1 in front of it. The test tells the proxy what to do to the
next N matching requests -- answer 500/503, answer slowly, or drop the connection -- and reads back what it
saw (e.g. how many PUTs arrived). tests/conftest.py
registers the fixtures once for the whole suite (a test names them as arguments).

    def test_x(s3_bucket, s3_proxy):
        s3_proxy.fail(3, status=503)                # the next 3 requests get 503 SlowDown
        ...  endpoint_url=s3_proxy.url ...
        assert s3_proxy.count("PUT") == 2

Credentials: s3_bucket sets AWS_* test credentials in the environment (and points the AWS config files at
nothing, so no profile or instance-metadata lookup happens).
"""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pytest

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
              "transfer-encoding", "upgrade", "expect"}
ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "SlowDown", 504: "GatewayTimeout"}


# ----------------------------------------------------------------------------------------------------------
# The moto server


class MotoServer:
    """moto's S3 (and everything else) on 127.0.0.1 in a background thread of this process."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self._server.stop()


# ----------------------------------------------------------------------------------------------------------
# The fault proxy


@dataclass
class Fault:
    kind: str                       # "fail" | "slow" | "drop"
    remaining: int
    status: int = 503
    code: str = ""
    delay: float = 0.0
    methods: tuple[str, ...] = ()   # empty: any method
    path_contains: str = ""         # matched against "/bucket/key?query"
    after_forward: bool = False     # drop: forward first, then lose the response (the write did happen)

    def matches(self, method: str, target: str) -> bool:
        return (self.remaining > 0 and (not self.methods or method in self.methods)
                and self.path_contains in target)


@dataclass
class ProxyRequest:
    method: str
    path: str                       # URL-decoded, no query: /bucket/key
    query: str
    fault: str | None = None
    status: int | None = None       # what the client was sent (None: nothing, connection dropped)
    access_key_id: str = ""         # from the SigV4 Authorization header: whose credentials signed it
    started: float = field(default_factory=time.monotonic)


class FaultProxy:
    """HTTP/1.1 proxy with keep-alive that forwards to `upstream` unless a queued fault matches."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.requests: list[ProxyRequest] = []
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_ProxyHandler):
            owner = proxy

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="s3-fault-proxy", daemon=True)
        self._thread.start()

    # -- control -----------------------------------------------------------------------------------------

    def fail(self, n: int, *, status: int = 503, code: str | None = None, methods: tuple[str, ...] = (),
             path_contains: str = "") -> None:
        """Answer the next `n` matching requests with `status` and an S3 error body (503 -> SlowDown)."""
        self._add(Fault("fail", n, status=status, code=code or ERROR_CODES.get(status, "InternalError"),
                        methods=methods, path_contains=path_contains))

    def slow(self, n: int, *, delay: float, methods: tuple[str, ...] = (), path_contains: str = "") -> None:
        """Forward the next `n` matching requests, then hold the answer for `delay` seconds (a server that
        did the work but answers past the client's read timeout)."""
        self._add(Fault("slow", n, delay=delay, methods=methods, path_contains=path_contains))

    def drop(self, n: int, *, after_forward: bool = False, methods: tuple[str, ...] = (),
             path_contains: str = "") -> None:
        """Close the connection without an answer for the next `n` matching requests; with after_forward the
        request reaches the server first (a write that happened but whose response was lost)."""
        self._add(Fault("drop", n, after_forward=after_forward, methods=methods, path_contains=path_contains))

    def _add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self.requests.clear()

    def count(self, *methods: str, path_contains: str = "", query_contains: str = "",
              fault: str | None = "any") -> int:
        """Requests seen with one of `methods` (all when none given); fault=None: only clean ones."""
        with self._lock:
            return sum(1 for r in self.requests
                       if (not methods or r.method in methods) and path_contains in r.path
                       and query_contains in r.query and (fault == "any" or r.fault == fault))

    def pending_faults(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._faults)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -- called by the handler ---------------------------------------------------------------------------

    def _take(self, method: str, path: str, query: str) -> tuple[ProxyRequest, Fault | None]:
        with self._lock:
            rec = ProxyRequest(method, path, query)
            self.requests.append(rec)
            for f in self._faults:
                if f.matches(method, f"{path}?{query}"):
                    f.remaining -= 1
                    rec.fault = f.kind
                    return rec, f
            return rec, None


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 15  # an idle keep-alive connection's thread ends after this
    owner: FaultProxy

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        split = urlsplit(self.path)
        body = self._read_body()
        rec, fault = self.owner._take(self.command, unquote(split.path), split.query)
        auth = self.headers.get("Authorization", "")
        if "Credential=" in auth:
            rec.access_key_id = auth.split("Credential=", 1)[1].split("/", 1)[0]
        try:
            if fault is not None and fault.kind == "fail":
                self._send_error(rec, fault)
                return
            if fault is not None and fault.kind == "drop" and not fault.after_forward:
                self._drop()
                return
            status, headers, payload = self._forward(body)
            if fault is not None and fault.kind == "slow":
                time.sleep(fault.delay)  # the write happened; the answer is late (past the read timeout)
            if fault is not None and fault.kind == "drop":
                self._drop()
                return
            rec.status = status
            self.send_response(status)
            for k, v in headers:
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            length = dict((k.lower(), v) for k, v in headers).get("content-length", "0") \
                if self.command == "HEAD" else str(len(payload))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True  # the client gave up (read timeout) and left

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                if k.lower() not in HOP_BY_HOP and k.lower() != "content-length":
                    conn.putheader(k, v)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            payload = resp.read()
            return resp.status, resp.getheaders(), payload
        finally:
            conn.close()

    def _send_error(self, rec: ProxyRequest, fault: Fault) -> None:
        xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
               f"<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>").encode()
        rec.status = fault.status
        self.send_response(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", "0" if self.command == "HEAD" else str(len(xml)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(xml)

    def _drop(self) -> None:
        # RST instead of FIN: the client sees the connection reset with no response at all.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()


# ----------------------------------------------------------------------------------------------------------
# Fixtures


@dataclass
class S3Bucket:
    name: str
    endpoint_url: str  # moto itself, bypassing the proxy
    client: object     # a boto3 client on `endpoint_url`, for assertions

    def store_url(self, base: str = "") -> str:
        return f"s3://{self.name}/{base}" if base else f"s3://{self.name}"

    def keys(self, prefix: str = "") -> list[str]:
        """Every key under `prefix`, as a list (a duplicate would show twice)."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                    "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def moto_server():
    """A MotoServer on 127.0.0.1 for the whole session (stopped at the end)."""
    server = MotoServer()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_proxy(moto_server):
    """A fresh FaultProxy in front of the session's moto server."""
    proxy = FaultProxy(moto_server.host, moto_server.port)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def s3_bucket(moto_server, monkeypatch, tmp_path) -> S3Bucket:
    """An empty bucket with a unique name on the moto server; AWS test credentials in the environment."""
    import boto3
    from botocore.config import Config

    for k, v in TEST_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = boto3.session.Session().client(
        "s3", endpoint_url=moto_server.url, region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30))
    name = f"v4rl-test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return S3Bucket(name, moto_server.url, client)
