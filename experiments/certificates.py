"""Certificates and keys for a local or test deployment: a CA, a server certificate, node keys.

``python -m experiments.certificates OUT [--host NAME_OR_IP ...] [--nodes N]
[--superlink HOST:PORT [--connection NAME]]`` writes into OUT:

``ca.crt``
    A test CA's certificate (public): the SuperLink, the devices and the ``flwr`` CLI
    verify the server by it.
``server.pem``, ``server.key``
    A server certificate the CA signed for 127.0.0.1, localhost and every ``--host``
    (an IP address as an IP name, anything else as a DNS name), and its private key.
``node0.key``, ``node0.key.pub``, ...
    N SuperNode key pairs (``--nodes``), named as ``ssh-keygen -f node0.key`` names them.

Private keys are created readable by their owner only (0600), never wider, not even
for a moment. With ``--superlink`` it also writes the ``flwr`` CLI's connection to that
SuperLink (``[superlink.NAME]`` in ``$FLWR_HOME/config.toml``, verified by ``ca.crt``)
and makes it the default one, so ``flwr supernode ls`` needs no connection name.

For prototyping and tests (the tests make theirs with it); a real federation gets its
certificates from its operator's CA. EC P-384 throughout: Flower's SuperNode
authentication takes NIST-curve keys (the private key in OpenSSH format, the public one
as an OpenSSH line).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: Names every server certificate carries: what a process on the server's own host dials.
LOCAL_HOSTS = ("127.0.0.1", "localhost")
#: A DNS name: dot-separated labels of letters, digits and inner hyphens (a leading ``*.``
#: for a wildcard), an optional final dot.
DNS_NAME = re.compile(
    r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
    r"[A-Za-z0-9])?)*\.?")
#: The CLI connection ``--superlink`` writes, unless ``--connection`` names another.
DEFAULT_CONNECTION = "splitlearn"


@dataclass(frozen=True)
class Certificates:
    """PEM files of a test CA and of a server certificate it signed for 127.0.0.1."""

    ca: Path
    certificate: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey, fmt: serialization.PrivateFormat) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` readable and writable by its owner only (0600).

    The bytes go into a new file created with that mode, which then replaces ``path``:
    an existing file's wider mode is not inherited, and no reader ever finds the key in
    a file others can read (nor half written).
    """
    staging = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


def subject_alternative_name(host: str) -> x509.GeneralName:
    """Return how a server certificate names ``host``: an IP name for an address, else DNS.

    A client that dials an IP address (a lab without DNS) checks the certificate's IP
    names, never its DNS names, so an address must go in as one. ``[::1]`` is read as
    ``::1``. ValueError naming ``--host`` for anything that is neither (a port, a URL).
    """
    text = host.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return x509.IPAddress(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if not DNS_NAME.fullmatch(text) or len(text) > 253:
        hint = (" (a host takes no port or scheme: give the name or address alone)"
                if any(c in text for c in ":/") else "")
        raise ValueError(f"--host {host!r} is neither an IP address nor a DNS name{hint}")
    return x509.DNSName(text)


def subject_alternative_names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Return the names of :data:`LOCAL_HOSTS` and ``hosts``, each once, in that order."""
    names: list[x509.GeneralName] = []
    for host in (*LOCAL_HOSTS, *hosts):
        name = subject_alternative_name(host)
        if name not in names:
            names.append(name)
    return names


def make_certificates(folder: Path, *, name: str = "",
                      hosts: Sequence[str] = ()) -> Certificates:
    """Write a CA, a server certificate it signed and the server's key into ``folder``.

    The files are ``ca.crt``, ``server.pem`` and ``server.key`` (0600), each prefixed
    ``NAME-`` if ``name`` is given (a second CA beside the first). The certificate
    names 127.0.0.1, localhost and ``hosts`` (see :func:`subject_alternative_name`);
    it is valid from 5 minutes ago for a day.
    """
    names = subject_alternative_names(hosts)  # a bad host fails before anything is written
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5),
             "not_valid_after": now + datetime.timedelta(days=1)}
    label = name or "splitlearn test"
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder(subject_name=_name(f"{label} CA"),
                                  issuer_name=_name(f"{label} CA"),
                                  public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    certificate = (
        x509.CertificateBuilder(subject_name=_name(f"{label} server"), issuer_name=ca.subject,
                                public_key=key.public_key(),
                                serial_number=x509.random_serial_number(), **valid)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256()))
    prefix = f"{name}-" if name else ""
    files = Certificates(folder / f"{prefix}ca.crt", folder / f"{prefix}server.pem",
                         folder / f"{prefix}server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    write_private(files.key, _pem_key(key, serialization.PrivateFormat.PKCS8))
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Write a SuperNode's key pair, ``NAME.key`` (0600) and ``NAME.key.pub``; return them.

    Named as ``ssh-keygen -t ecdsa -b 384 -N "" -f NAME.key`` names its pair.
    """
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"{name}.key", folder / f"{name}.key.pub"
    write_private(private, _pem_key(key, serialization.PrivateFormat.OpenSSH))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def certificate_hosts(certificate: Path) -> list[str]:
    """Return the names a server certificate carries (IP names as addresses)."""
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


def check_superlink(address: str, hosts: Sequence[str]) -> None:
    """Check that ``address`` is ``HOST:PORT`` whose host a certificate for ``hosts`` names.

    ValueError naming ``--superlink`` (and the ``--host`` to add) otherwise: the CLI
    would fail its TLS handshake with that SuperLink.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--superlink {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9091")
    try:
        dialled = subject_alternative_name(host)
    except ValueError:
        raise ValueError(f"--superlink {address!r}: {host!r} is neither an IP address nor "
                         "a DNS name") from None
    names = subject_alternative_names(hosts)
    if dialled not in names:
        named = ", ".join(str(n.value) for n in names)
        raise ValueError(f"--superlink {address}: the server certificate would not name "
                         f"{host!r} (it names {named}); add --host {dialled.value}")


def write_cli_connection(name: str, address: str, files: Certificates) -> Path:
    """Make ``[superlink.NAME]`` (``address``, verified by the CA) the CLI's default connection.

    Through Flower's own reader and writer of ``$FLWR_HOME/config.toml`` (``~/.flwr``;
    created if missing, other connections kept). Returns the file's path.
    """
    from flwr.cli.flower_config import (
        read_flower_config,
        set_default_superlink_connection,
        write_superlink_connection,
    )
    from flwr.cli.typing import SuperLinkConnection

    write_superlink_connection(SuperLinkConnection(
        name=name, address=address, root_certificates=str(files.ca.resolve())))
    set_default_superlink_connection(name)
    return read_flower_config()[1]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line (argparse exits naming a bad flag)."""
    parser = argparse.ArgumentParser(prog="python -m experiments.certificates",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the files into")
    parser.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                        help="a name or IP address devices dial the server by (repeatable; "
                             "127.0.0.1 and localhost are always in)")
    parser.add_argument("--nodes", type=int, default=0, metavar="N",
                        help="SuperNode key pairs to make (node0.key, node0.key.pub, ...)")
    parser.add_argument("--superlink", metavar="HOST:PORT",
                        help="also make this SuperLink the flwr CLI's default connection")
    parser.add_argument("--connection", default=DEFAULT_CONNECTION, metavar="NAME",
                        help="that connection's name (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.nodes < 0:
        parser.error(f"--nodes {args.nodes}: give 0 or more")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", args.connection):
        parser.error(f"--connection {args.connection!r}: letters, digits, '-' and '_' only")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Write a CA, a server certificate, node keys and (optionally) the CLI's connection."""
    args = parse_args(argv)
    try:
        if args.superlink:  # a bad address fails before anything is written
            check_superlink(args.superlink, args.host)
        files = make_certificates(args.out, hosts=args.host)
        keys = [make_node_key(args.out, f"node{i}") for i in range(args.nodes)]
        config = (write_cli_connection(args.connection, args.superlink, files)
                  if args.superlink else None)
    except ValueError as err:
        raise SystemExit(f"experiments.certificates: {err}") from None
    folder = args.out.resolve()
    print(f"wrote into {folder}:")
    print(f"  {files.ca.name:<16} the CA's certificate (public): all verify the server by it")
    print(f"  {files.certificate.name:<16} server certificate for "
          f"{', '.join(certificate_hosts(files.certificate))}")
    print(f"  {files.key.name:<16} its private key (0600): stays on the server")
    for i, (private, public) in enumerate(keys):
        print(f"  {private.name:<16} device {i}'s private key (0600): to that device only")
        print(f"  {public.name:<16} its public key: flwr supernode register {public.resolve()}")
    if config is not None:
        print(f"flwr CLI: connection {args.connection!r} ({args.superlink}, verified by "
              f"{files.ca.name}) is the default in {config}")


if __name__ == "__main__":
    main()
