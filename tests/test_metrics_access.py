"""Who can read the metrics (they name tasks and tenants): `oncelery metrics` listens on 127.0.0.1 unless told
otherwise, serves HTTPS with the certificate it is given, and with basic auth answers 401 to anything but the
user and the password from its file. Real HTTP(S) scrapes of a served exporter.

On SQLite only: who may connect does not depend on the store (the reads are tested on both in test_metrics.py
and test_metrics_without_scans.py).
"""

from __future__ import annotations

import base64
import http.client
import re
import shutil
import signal
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from oncelery.cli import oncelery as oncelery_cli
from oncelery.ops.exporter import Exporter, serve
from oncelery.ops.metrics import claims_registry
from oncelery.store.schema import upgrade_schema
from oncelery.testing import wait_until
from tests import services

USER, PASSWORD = "prometheus", "s3cret-of-the-scraper"


@pytest.fixture
def claims(tmp_path: Path) -> str:
    """A migrated SQLite claims database."""
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    upgrade_schema(url)
    return url


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    """The password, as an operator writes it (with a trailing newline)."""
    path = tmp_path / "password"
    path.write_text(PASSWORD + "\n")
    return path


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made by the openssl command."""
    services.need("openssl", shutil.which("openssl") is not None, "apt-get install openssl")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"),
            *("-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def basic(user: str, password: str) -> str:
    """An Authorization header value for `user:password`."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def get(url: str, authorization: str | None = None, context: ssl.SSLContext | None = None) -> tuple[int, str, str]:
    """(status, WWW-Authenticate, body) of a GET."""
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.headers.get("WWW-Authenticate", ""), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("WWW-Authenticate", ""), exc.read().decode()


@pytest.fixture
def exporter(
    claims: str, password_file: Path, certificate: tuple[Path, Path], tmp_path: Path
) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """The real `oncelery metrics` with TLS and basic auth, and no --addr (the default); its port."""
    port = free_port()
    cert, key = certificate
    argv = [services.ONCELERY, "--database-url", claims, "metrics", "--port", str(port)]
    argv += ["--tls-cert", str(cert), "--tls-key", str(key)]
    argv += ["--basic-auth-user", USER, "--basic-auth-password-file", str(password_file)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or services.port_open("127.0.0.1", port), 30, what="the exporter")
        assert proc.poll() is None, proc.communicate()[0]
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_the_served_exporter_needs_tls_and_the_password_and_listens_on_loopback(
    exporter: tuple[int, subprocess.Popen[str]], certificate: tuple[Path, Path]
) -> None:
    """Over HTTPS (the test's certificate verified): no credentials, a wrong password or a wrong user get 401 and
    a Basic challenge; the right ones get the metrics. Plain HTTP gets nothing; nor does 127.0.0.2 (the default
    address is 127.0.0.1, not every interface)."""
    port, proc = exporter
    url = f"https://127.0.0.1:{port}/metrics"
    trusted = ssl.create_default_context(cafile=str(certificate[0]))
    for authorization in (None, basic(USER, "wrong"), basic("someone", PASSWORD), basic(USER, PASSWORD + "x")):
        status, challenge, body = get(url, authorization, trusted)
        assert (status, challenge) == (401, 'Basic realm="oncelery metrics", charset="UTF-8"'), authorization
        assert "oncelery_" not in body
    status, _, body = get(url, basic(USER, PASSWORD), trusted)
    assert status == 200 and "oncelery_database_up 1.0" in body
    with pytest.raises((urllib.error.URLError, http.client.HTTPException, ConnectionError)):
        get(f"http://127.0.0.1:{port}/metrics", basic(USER, PASSWORD))
    assert not services.port_open("127.0.0.2", port)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0 and f"https://127.0.0.1:{port}/metrics" in out and "basic auth as" in out


def test_basic_auth_refuses_every_malformed_credential(claims: str) -> None:
    """Another scheme, bad base64, no colon, an extra field, an empty header: 401. The scheme's case does not
    matter (RFC 7617). Served over real HTTP on a free port, in this process."""
    server, thread = serve(claims_registry(claims), Exporter(0, user=USER, password=PASSWORD))
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        for authorization in (
            f"Bearer {PASSWORD}",
            "Basic !!!not-base64",
            "Basic " + base64.b64encode(USER.encode()).decode(),
            basic(USER, PASSWORD + ":extra"),
            "Basic ",
        ):
            assert get(url, authorization)[0] == 401, authorization
        assert get(url, "basic " + basic(USER, PASSWORD).split(" ", 1)[1])[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--basic-auth-user", USER], "needs both --basic-auth-user and --basic-auth-password-file"),
        (["--basic-auth-password-file", "{password}"], "needs both --basic-auth-user and --basic-auth-password-file"),
        (["--basic-auth-user", USER, "--basic-auth-password-file", "{empty}"], "is empty: write the password"),
        (["--tls-cert", "{password}"], "TLS needs both --tls-cert and --tls-key"),
    ],
)
def test_the_command_refuses_half_a_login_or_an_empty_password(
    claims: str, password_file: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    """Half a login or half a TLS pair would serve without auth or in clear: refused before listening (exit 2)."""
    empty = tmp_path / "empty"
    empty.write_text("\n")
    argv = [a.format(password=password_file, empty=empty) for a in args]
    result = CliRunner().invoke(oncelery_cli, ["--database-url", claims, "metrics", "--port", "0", *argv])
    assert result.exit_code == 2 and message in result.output, result.output


CELERY_EXPORTER_PORT = 9808  # danihodovic/celery-exporter's default, allocated to it on Prometheus' port list


def test_the_default_port_is_not_celery_exporters() -> None:
    """`oncelery metrics` defaults to a port no exporter holds on Prometheus' default-port list, so it runs beside
    celery-exporter on one host; the compose file, the service script, the docs and the tests all say the same
    port (only CHANGELOG.md may still name the old one)."""
    result = CliRunner().invoke(oncelery_cli, ["metrics", "--help"])
    assert result.exit_code == 0 and "default: 10734;" in " ".join(result.output.split()), result.output
    here = Path(__file__).resolve()
    root = here.parent.parent
    places = [root / "docker-compose.yml", root / ".env.example", *(root / "deploy").rglob("*")]
    for room in ("idempotency", "docs", "tests"):
        places += [p for p in (root / room).rglob("*") if p.suffix in {".py", ".md", ".yml", ".yaml"}]
    # A use of the port (":9808", "--port 9808", "PORT: 9808", "= 9808"; 19808 was its host side), not prose.
    use = re.compile(rf"(:|--port |PORT\W+|= )1?{CELERY_EXPORTER_PORT}\b")
    stale = [str(p.relative_to(root)) for p in places if p.is_file() and p != here and use.search(p.read_text())]
    assert stale == []
