"""The environment and the config file: a misspelt ``CKPTD_*`` variable stops
start-up naming the key meant, and a value the environment or a flag overrides
in the config file is said at start-up, never silently lost."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptd.daemon.app import config

from .conftest import CKPTD, Daemon
from .test_cli_operate import run


def test_a_misspelt_variable_stops_serve_naming_the_key(tmp_path: Path) -> None:
    out = run(
        "serve",
        "--root",
        str(tmp_path / "root"),
        "--socket",
        str(tmp_path / "s.sock"),
        env={"CKPTD_STAGING_BUDGT_BYTES": "1"},
    )
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptd: error: "), out.stderr
    assert "CKPTD_STAGING_BUDGT_BYTES" in lines[0]
    assert "did you mean CKPTD_STAGING_BUDGET_BYTES?" in lines[0]
    assert not (tmp_path / "root").exists()  # refused before anything was made


def test_the_variables_ckptd_reads_elsewhere_are_no_typos() -> None:
    env = {
        "CKPTD_CONFIG": "/etc/ckptd.toml",
        "CKPTD_FAILPOINTS": "",
        "CKPTD_FAILPOINT_DIR": "/tmp/x",
        "CKPTD_FUZZ_SEED": "3",
        "CKPTD_SOCKET": "/run/ckptd/ckptd.sock",
        "CKPTD_ROOT": "/x",
    }
    config.refuse_unknown_env(env)  # nothing raised
    with pytest.raises(config.ConfigError, match="did you mean CKPTD_REMOTE"):
        config.refuse_unknown_env({**env, "CKPTD_REMOTTE": "s3://b"})


def test_load_reports_each_override_of_the_config_file(tmp_path: Path) -> None:
    f = tmp_path / "ckptd.toml"
    f.write_text('root = "/data/ckptd"\nwrite_workers = 3\nio_nice = 5\n')
    said: list[str] = []
    cfg = config.load(
        f,
        {"CKPTD_ROOT": "/var/lib/ckptd", "CKPTD_IO_NICE": "5", "CKPTD_WRITE_WORKERS": "4"},
        {"write_workers": "6"},
        said,
    )
    assert (str(cfg.root), cfg.write_workers, cfg.io_nice) == ("/var/lib/ckptd", 6, 5)
    assert said == [
        f"root: environment variable CKPTD_ROOT=/var/lib/ckptd overrides config file {f}'s "
        "/data/ckptd",
        f"write_workers: environment variable CKPTD_WRITE_WORKERS=4 overrides config file {f}'s 3",
        "write_workers: flag --write-workers=6 overrides environment variable "
        "CKPTD_WRITE_WORKERS=4",
    ]  # io_nice: the same value from both, nothing lost


def test_serve_and_verify_say_what_overrides_the_config_file(
    make_daemon: Any, tmp_path: Path
) -> None:
    f = tmp_path / "ckptd.toml"
    f.write_text('node_id = "from-file"\nwrite_workers = 3\n')
    daemon: Daemon = make_daemon(extra_args=["--config", str(f)], env={"CKPTD_WRITE_WORKERS": "4"})
    assert daemon.status().node_id == "test-node"  # the launcher's flag won
    log = daemon.log_text()
    assert (
        f"write_workers: environment variable CKPTD_WRITE_WORKERS=4 overrides config file {f}'s 3"
        in log
    )
    assert f"node_id: flag --node-id=test-node overrides config file {f}'s from-file" in log
    # The operator's commands say it too (on stderr, before their answer).
    f.write_text(f'root = "{tmp_path / "file-root"}"\n')
    out = run("verify", "--config", str(f), env={"CKPTD_ROOT": str(tmp_path / "env-root")})
    assert (
        f"ckptd: warning: root: environment variable CKPTD_ROOT={tmp_path / 'env-root'} "
        f"overrides config file {f}'s {tmp_path / 'file-root'}" in out.stderr
    ), out.stderr


def test_the_client_warns_once_about_a_misspelt_socket_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ckptd.core import wire

    monkeypatch.delenv("CKPTD_SOCKET", raising=False)
    monkeypatch.setenv("CKPTD_SOKET", "/run/elsewhere.sock")
    monkeypatch.setenv("CKPTD_SOCKET_GROUP", "ckptd")  # the daemon's setting: no warning
    monkeypatch.setattr(wire, "_warned_socket_variables", set())
    with pytest.warns(UserWarning, match="CKPTD_SOKET .*did you mean CKPTD_SOCKET") as seen:
        assert wire.socket_path() == wire.DEFAULT_SOCKET
        wire.socket_path()  # once, not at every connection
    assert len(seen) == 1, [str(w.message) for w in seen]
    monkeypatch.setenv("CKPTD_SOCKET", "/run/x.sock")
    assert wire.socket_path() == "/run/x.sock"


def test_gs_without_credentials_fails_at_once_naming_them(tmp_path: Path) -> None:
    # Nothing to find: no key file, an empty gcloud directory, and a metadata server
    # address where nothing listens (a closed port on this host).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CKPTD_", "GOOGLE_", "GCE_", "CLOUDSDK_", "STORAGE_EMULATOR"))
        and k != "NO_GCE_CHECK"
    }
    env = {
        **clean,
        "HOME": str(tmp_path / "home"),
        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud"),
        "GCE_METADATA_HOST": closed,
        "GCE_METADATA_IP": closed,
    }
    for args in (
        ["serve", "--root", str(tmp_path / "r"), "--socket", str(tmp_path / "s.sock")],
        ["pull", "job", str(tmp_path / "dest"), "--socket", str(tmp_path / "none.sock")],
    ):
        out = subprocess.run(
            [CKPTD, *args, "--remote", "gs://ckptd-any-bucket/x"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,  # generous for a busy machine; gcsfs alone took ~50 s here
        )
        assert out.returncode == 2, out
        errors = [x for x in out.stderr.splitlines() if x.startswith("ckptd: error:")]
        assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
        for name in (
            "no Google Cloud credentials",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "gcloud auth application-default login",
            f"metadata server at {closed}",
        ):
            assert name in errors[0], (name, errors[0])


def test_gs_credentials_are_taken_from_where_google_auth_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptd.daemon.remote.errors import RemoteError
    from ckptd.daemon.remote.gcs import credentials

    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_IP", "GCE_METADATA_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # no metadata server asked, here or by google.auth
    user = {"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"}
    # gcloud's application-default file (from `gcloud auth application-default login`).
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    (tmp_path / "gcloud").mkdir()
    (tmp_path / "gcloud" / "application_default_credentials.json").write_text(json.dumps(user))
    assert credentials(os.environ).client_id == "c"
    # An explicit key file wins; one that is missing is named in the error.
    (tmp_path / "key.json").write_text(json.dumps({**user, "client_id": "k"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "key.json"))
    assert credentials(os.environ).client_id == "k"
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(RemoteError, match=r"no Google Cloud credentials.*missing\.json"):
        credentials(os.environ)
