"""experiments.certificates: names a client dials by IP verify, private keys stay private."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
import tomli
from cryptography import x509

from experiments.certificates import (
    check_superlink,
    main,
    make_certificates,
    make_node_key,
    subject_alternative_name,
    write_private,
)


def names_in(certificate: Path) -> list[x509.GeneralName]:
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    return list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def handshake(files, server_hostname: str) -> None:
    """A TLS handshake with a server on 127.0.0.1 holding ``files``' certificate, the client
    checking it as one that dialled ``server_hostname`` (an IP address: its IP names)."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(files.certificate, files.key)
    client_context = ssl.create_default_context(cafile=str(files.ca))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve() -> None:
            connection, _ = listener.accept()
            # The client's verdict is the test's; a client that refuses us is no error here.
            with connection, contextlib.suppress(ssl.SSLError, OSError), \
                    server_context.wrap_socket(connection, server_side=True) as tls:
                tls.recv(1)  # until the client has closed

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    client_context.wrap_socket(raw, server_hostname=server_hostname):
                pass
        finally:
            server.join(timeout=10)


@pytest.mark.parametrize("host", ["10.1.2.3", "fd00::1"])
def test_an_address_goes_in_as_an_ip_name_and_a_client_dialling_it_verifies(tmp_path, host):
    files = make_certificates(tmp_path, hosts=[host, "server.example.org"])
    names = names_in(files.certificate)
    assert x509.IPAddress(ipaddress.ip_address(host)) in names
    assert x509.DNSName(host) not in names  # what made a device dialling by IP fail
    assert x509.DNSName("server.example.org") in names
    handshake(files, host)
    handshake(files, "server.example.org")
    handshake(files, "127.0.0.1")  # always in, as localhost is


def test_a_client_dialling_an_address_the_certificate_lacks_fails_the_handshake(tmp_path):
    files = make_certificates(tmp_path, hosts=["server.example.org"])
    with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
        handshake(files, "10.1.2.3")
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(files, "other.example.org")


def test_names_are_checked_and_each_written_once():
    assert subject_alternative_name("[::1]") == x509.IPAddress(ipaddress.ip_address("::1"))
    assert subject_alternative_name("*.example.org") == x509.DNSName("*.example.org")
    for bad, hint in [("10.1.2.3:9091", "takes no port"), ("https://server", "takes no port"),
                      ("a b", "neither"), ("", "neither"), ("-x.org", "neither")]:
        with pytest.raises(ValueError, match=f"--host {bad!r} .*{hint}"):
            subject_alternative_name(bad)


def test_private_keys_are_owner_only_from_their_first_byte(tmp_path, monkeypatch):
    opened_modes = []
    fdopen = os.fdopen

    def spy(fd, *args, **kwargs):  # before a byte is written, the file is already 0600
        opened_modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return fdopen(fd, *args, **kwargs)

    monkeypatch.setattr(os, "fdopen", spy)
    old = os.umask(0)  # nothing of the mode comes from the umask
    try:
        stale = tmp_path / "node0.key"
        stale.write_text("an older key, world-readable")
        stale.chmod(0o644)
        files = make_certificates(tmp_path)
        private, public = make_node_key(tmp_path, "node0")
    finally:
        os.umask(old)
    assert opened_modes == [0o600, 0o600]
    for key in (files.key, private):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert private == stale and "PRIVATE KEY" in private.read_text()
    assert stat.S_IMODE(public.stat().st_mode) == 0o666  # public, as the umask allows
    assert public.name == "node0.key.pub" and public.read_text().startswith("ecdsa-sha2-nistp384")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ca.crt", "node0.key", "node0.key.pub", "server.key", "server.pem"]  # no staging left


def test_a_failed_write_leaves_neither_the_key_nor_its_staging_file(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fdopen", broken)
    with pytest.raises(OSError, match="disk full"):
        write_private(tmp_path / "server.key", b"key")
    assert list(tmp_path.iterdir()) == []


def test_the_command_writes_the_files_and_the_clis_default_connection(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    main([str(tmp_path / "out"), "--host", "10.1.2.3", "--nodes", "2",
          "--superlink", "10.1.2.3:9091"])
    printed = capsys.readouterr().out
    for name in ("ca.crt", "server.pem", "server.key", "node1.key", "node1.key.pub"):
        assert name in printed and (tmp_path / "out" / name).is_file()
    assert "127.0.0.1, localhost, 10.1.2.3" in printed
    config = tomli.loads((tmp_path / "flwr" / "config.toml").read_text())
    assert config["superlink"]["default"] == "splitlearn"  # `flwr supernode ls` needs it
    assert config["superlink"]["splitlearn"] == {
        "address": "10.1.2.3:9091", "root-certificates": str(tmp_path / "out" / "ca.crt")}
    assert "local" in config["superlink"]  # Flower's own connections are kept


@pytest.mark.parametrize(("superlink", "message"), [
    ("10.9.9.9:9091", "would not name '10.9.9.9' .*add --host 10.9.9.9"),
    ("10.1.2.3", "expected HOST:PORT"),
    ("a b:9091", "'a b' is neither"),
])
def test_a_superlink_the_certificate_would_not_verify_is_refused_before_writing(
        tmp_path, monkeypatch, superlink, message):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    with pytest.raises(ValueError, match=message):
        check_superlink(superlink, ["10.1.2.3"])
    with pytest.raises(SystemExit, match="experiments.certificates: --superlink"):
        main([str(tmp_path / "out"), "--host", "10.1.2.3", "--superlink", superlink])
    assert not (tmp_path / "out").exists() and not (tmp_path / "flwr").exists()
