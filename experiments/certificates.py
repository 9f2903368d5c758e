"""Certificates and keys for a local or test deployment: a CA, a server certificate, node keys.

``python -m experiments.certificates OUT [--nodes N] [--host NAME ...]`` writes a CA
(``test-ca.crt``), a server certificate it signed for 127.0.0.1, localhost and the
given host names (``test-server.pem``, ``test-server.key``) and N SuperNode key pairs
(``nodeI.key``, ``nodeI.pub``). For prototyping and tests (the tests make theirs with
it); a real federation gets its certificates from its operator's CA.

EC P-384 throughout: Flower's SuperNode authentication takes NIST-curve keys
(the private key in OpenSSH format, the public one as an OpenSSH line).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


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


def make_certificates(folder: Path, *, name: str = "test",
                      hosts: Sequence[str] = ()) -> Certificates:
    """Write ``NAME-ca.crt``, ``NAME-server.pem`` and ``NAME-server.key`` into ``folder``.

    The server certificate names 127.0.0.1, localhost and ``hosts``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5),
             "not_valid_after": now + datetime.timedelta(days=1)}
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (x509.CertificateBuilder(subject_name=_name(f"{name} CA"), issuer_name=_name(f"{name} CA"),
                                  public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP384R1())
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
             *(x509.DNSName(h) for h in hosts)]
    certificate = (
        x509.CertificateBuilder(subject_name=_name("127.0.0.1"), issuer_name=ca.subject,
                                public_key=key.public_key(),
                                serial_number=x509.random_serial_number(), **valid)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256()))
    files = Certificates(folder / f"{name}-ca.crt", folder / f"{name}-server.pem",
                         folder / f"{name}-server.key")
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(key, serialization.PrivateFormat.PKCS8))
    return files


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """Write a SuperNode's key pair (``NAME.key``, ``NAME.pub``); return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"{name}.key", folder / f"{name}.pub"
    private.write_bytes(_pem_key(key, serialization.PrivateFormat.OpenSSH))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH))
    return private, public


def main(argv: Sequence[str] | None = None) -> None:
    """Write a CA, a server certificate and node keys into the folder given."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--nodes", type=int, default=0, help="SuperNode key pairs to make")
    parser.add_argument("--host", action="append", default=[],
                        help="a name devices dial the server by (repeatable)")
    args = parser.parse_args(argv)
    files = make_certificates(args.out, hosts=args.host)
    keys = [make_node_key(args.out, f"node{i}") for i in range(args.nodes)]
    print(f"CA {files.ca}\nserver certificate {files.certificate}, key {files.key}")
    for private, public in keys:
        print(f"node key {private} (register {public})")


if __name__ == "__main__":
    main()
