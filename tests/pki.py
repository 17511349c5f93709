"""Test certificates made with the openssl command: a CA and a node certificate
naming 127.0.0.1 and ``ckptd-peer`` (every node shares it), and a second, unrelated
CA with a certificate of its own (a caller the peers must refuse)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

SHARED_NAME = "ckptd-peer"


@dataclass(frozen=True)
class Pki:
    """Paths of one CA's files and of a certificate it signed."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, *, san: str = f"IP:127.0.0.1,DNS:{SHARED_NAME}") -> Pki:
    """A fresh CA in ``directory`` and a node certificate it signed (EC P-256: fast)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificates to test TLS with")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.crt", "node.key", "node.csr", "node.crt")
    )
    curve = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *curve, "-keyout", ca_key, "-out", ca, "-days", "2",
             "-subj", f"/CN=ckptd test CA {directory.name}")  # fmt: skip
    _openssl("req", "-new", *curve, "-keyout", key, "-out", csr, "-subj", "/CN=ckptd node")
    ext = directory / "ext.cnf"
    ext.write_text(
        f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n"
    )
    _openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
             "-out", cert, "-days", "2", "-extfile", ext)  # fmt: skip
    return Pki(ca=ca, cert=cert, key=key)
