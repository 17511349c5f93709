"""No access key id, secret or credential-bearing URL reaches a log line, an error or status."""

from __future__ import annotations

import io
import logging
from typing import Any

import numpy as np
import pytest

from ckptd.core.redact import MASK, Redactor, has_credentials
from ckptd.daemon.app import config as config_mod
from ckptd.daemon.app import logs
from ckptd.proto import ckptd_pb2 as pb

from .conftest import Daemon

KEY_ID = "AKIACKPTDTEST7Q3XW9Z"
SECRET = "ckptdSecret/Zq8vX2mN5+pL0tR4wY7uI1oK3jH6gF9d"


def everything_said(d: Daemon) -> str:
    """The daemon's log and every text its status, events and listing carry."""
    status = d.status()
    events = d.connection.list_events(pb.ListEventsRequest())
    listed = d.connection.list_checkpoints(pb.ListCheckpointsRequest())
    return "\n".join([d.log_text(), str(status), str(events), str(listed)])


def test_debug_logs_and_status_hold_no_credentials(make_daemon: Any) -> None:
    """A save that drains to S3 and a restore from it, at log_level debug, print neither
    the access key id nor the secret (botocore logs both at DEBUG when let)."""
    from .servers import SeaweedS3

    with SeaweedS3(access_key=KEY_ID, secret_key=SECRET) as s3:
        bucket = s3.make_bucket("ckptd-credentials")
        args = ["--remote", f"s3://{bucket}/ckpt", "--log-level", "debug"]
        saver = make_daemon(extra_args=args, env=s3.env())
        client = saver.client("creds")
        for step in (1, 2):
            client.save(step, {"w": np.arange(100_000.0)}).wait("durable", timeout=120)
        # A second node root: restoring there downloads step 2 from the bucket.
        reader = make_daemon(extra_args=args, env=s3.env())
        tree, _ = reader.client("creds").restore()
        assert tree["w"][-1] == 99_999.0
        assert reader.events_of(pb.STEP_EVENT_FETCHED, "creds")
        # Wrong credentials: the start-up error must not echo them either.
        wrong = {**s3.env(), "AWS_SECRET_ACCESS_KEY": SECRET[::-1]}
        refused = make_daemon(extra_args=args, env=wrong, start=False)
        with pytest.raises(RuntimeError):
            refused.start()
        said = [everything_said(saver), everything_said(reader), refused.log_text()]
    for text in said:
        assert KEY_ID not in text and SECRET not in text and SECRET[::-1] not in text


def test_third_party_request_logging_is_capped_and_lines_are_masked() -> None:
    out = io.StringIO()
    logs.setup("debug", out, Redactor([SECRET, KEY_ID]))
    try:
        logging.getLogger("botocore.endpoint").debug("Sending http request: %s", KEY_ID)
        logging.getLogger("s3fs").debug("CALL: put_object %s", SECRET)
        logging.getLogger("ckptd.test").debug("upload failed with %s/%s", KEY_ID, SECRET)
        try:
            raise ValueError(f"bad signature for {KEY_ID}")
        except ValueError:
            logging.getLogger("ckptd.test").exception("drain failed")
    finally:
        logs.setup("warning")
    text = out.getvalue()
    assert "Sending http request" not in text and "put_object" not in text
    assert f"upload failed with {MASK}/{MASK}" in text
    assert f"bad signature for {MASK}" in text
    assert KEY_ID not in text and SECRET not in text


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        ("s3://AKIAX:s3cr3t@bucket/prefix", "s3cr3t"),
        ("https://user:pa55@example.com/x", "pa55"),
        ("GET /b/k?X-Amz-Credential=AKIAZZ%2F2024&X-Amz-Signature=abcdef01", "AKIAZZ"),
        ("Authorization: AWS4-HMAC-SHA256 Credential=AKIAQQ/20240101/us-east-1/s3", "AKIAQQ"),
        ("{'aws_secret_access_key': 'zzTopSecret'}", "zzTopSecret"),
        ("token=ya29.abcdef", "ya29.abcdef"),
    ],
)
def test_credential_patterns_are_masked(text: str, hidden: str) -> None:
    masked = Redactor([])(text)
    assert hidden not in masked and MASK in masked


def test_plain_text_is_left_alone() -> None:
    line = "job/3 DURABLE in 0.2 s after handoff (s3://bucket/ckpt, 12 files)"
    assert Redactor([])(line) == line
    assert not has_credentials("s3://bucket/prefix") and not has_credentials("file:///x/y")


@pytest.mark.parametrize("key", ["remote", "remote_endpoint_url"])
def test_urls_with_credentials_are_refused_without_echoing_them(key: str) -> None:
    url = "s3://AKIAX:s3cr3tValue@bucket/p" if key == "remote" else "http://k:s3cr3tValue@h:1"
    flags = {"remote": "s3://bucket/p", key: url}
    with pytest.raises(config_mod.ConfigError, match="carries credentials") as info:
        config_mod.load(env={}, flags=flags)
    assert "s3cr3tValue" not in str(info.value) and "AKIAX" not in str(info.value)
