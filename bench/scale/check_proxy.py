"""Smoke check of ``proxy.py`` against a real SeaweedFS server (~10-20 s).

Signed botocore requests (single PUT with a CRC32C checksum, HEAD, ranged GET,
multipart, paginated LISTs, copy, batch and single deletes), a presigned ranged GET
over a kept-alive ``http.client`` connection (what ckptd's ranged downloads do), s3fs
(aiobotocore, what the daemon uses), a per-node access key; then every count.

    .venv/bin/python bench/scale/check_proxy.py
"""

from __future__ import annotations

import http.client
import os
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))
from cluster import per_node_keys  # noqa: E402
from proxy import ProxyProcess  # noqa: E402

from ckptd.core import checksum  # noqa: E402
from tests.servers import SeaweedS3  # noqa: E402

B = "chk"
MIB = 2**20


def client(s3: SeaweedS3, url: str, key: str) -> Any:
    """A botocore S3 client through the proxy, signing with access key ``key``."""
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=url,
        region_name=s3.REGION,
        aws_access_key_id=key,
        aws_secret_access_key=s3.secret_key,
        config=botocore.config.Config(retries={"max_attempts": 1}),
    )


def botocore_calls(c: Any) -> bytes:
    """Every kind of request ckptd makes, and a few more; returns the multipart body."""
    body = os.urandom(3 * MIB)
    crc = checksum.to_base64(checksum.value(body))
    c.put_object(Bucket=B, Key="a/node-0001/x", Body=body, ChecksumCRC32C=crc)
    head = c.head_object(Bucket=B, Key="a/node-0001/x", ChecksumMode="ENABLED")
    assert head["ContentLength"] == len(body), head
    assert head.get("ChecksumCRC32C"), head
    got = c.get_object(Bucket=B, Key="a/node-0001/x", Range="bytes=10-19")["Body"].read()
    assert got == body[10:20]
    assert c.get_object(Bucket=B, Key="a/node-0001/x")["Body"].read() == body
    big = body + body
    up = c.create_multipart_upload(Bucket=B, Key="a/big")["UploadId"]
    etags = [
        c.upload_part(Bucket=B, Key="a/big", UploadId=up, PartNumber=n, Body=part)["ETag"]
        for n, part in ((1, big), (2, b"tail"))
    ]
    assert len(c.list_parts(Bucket=B, Key="a/big", UploadId=up)["Parts"]) == 2
    assert len(c.list_multipart_uploads(Bucket=B).get("Uploads", [])) == 1
    parts = [{"PartNumber": n + 1, "ETag": e} for n, e in enumerate(etags)]
    c.complete_multipart_upload(
        Bucket=B, Key="a/big", UploadId=up, MultipartUpload={"Parts": parts}
    )
    for i in range(5):
        c.put_object(Bucket=B, Key=f"l/node-{i:04d}/k", Body=b"x")
    pages = c.get_paginator("list_objects_v2").paginate(
        Bucket=B, Prefix="l/", PaginationConfig={"PageSize": 2}
    )
    assert sum(len(p.get("Contents", [])) for p in pages) == 5
    assert len(c.list_objects(Bucket=B, Prefix="l/")["Contents"]) == 5
    c.copy_object(Bucket=B, Key="l/copy", CopySource={"Bucket": B, "Key": "l/node-0000/k"})
    c.delete_objects(Bucket=B, Delete={"Objects": [{"Key": "l/copy"}, {"Key": "l/node-0004/k"}]})
    c.delete_object(Bucket=B, Key="l/node-0003/k")
    c.head_bucket(Bucket=B)
    return big + b"tail"


def ranged_http_client(c: Any, want: bytes) -> None:
    """Presigned URL, parts read over one kept-alive connection, as daemon/remote/ranged.py."""
    url = urlsplit(
        c.generate_presigned_url("get_object", Params={"Bucket": B, "Key": "a/big"}, ExpiresIn=600)
    )
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    for start in range(0, len(want), 5 * MIB):
        end = min(len(want), start + 5 * MIB) - 1
        headers = {"Range": f"bytes={start}-{end}", "Accept-Encoding": "identity"}
        conn.request("GET", f"{url.path}?{url.query}", headers=headers)
        r = conn.getresponse()
        assert r.status == 206 and r.length == end - start + 1, (r.status, r.length)
        assert r.read() == want[start : end + 1]
    conn.close()


def s3fs_calls(s3: SeaweedS3, url: str) -> None:
    """What the daemon's backend does: async s3fs (aiobotocore) with a custom endpoint."""
    import s3fs

    fs = s3fs.S3FileSystem(**{**s3.s3fs_kwargs(), "endpoint_url": url}, skip_instance_cache=True)
    fs.pipe(f"{B}/s/f", b"y" * 100)
    assert fs.cat(f"{B}/s/f") == b"y" * 100
    assert f"{B}/s/f" in fs.find(f"{B}/s")
    fs.rm(f"{B}/s/f")


def main() -> None:
    """Run the checks; print the counts; exit 1 on a miss."""
    with tempfile.TemporaryDirectory(prefix="ckptd-proxy-check-") as tmp:
        s3 = SeaweedS3(Path(tmp) / "s3")
        per_node_keys(s3, 2)
        proxy = None
        try:
            s3.start()
            s3.make_bucket(B)
            proxy = ProxyProcess(s3.endpoint_url, Path(tmp) / "proxy.log").start()
            c = client(s3, proxy.url, s3.access_key)
            big = botocore_calls(c)
            ranged_http_client(c, big)
            s3fs_calls(s3, proxy.url)
            client(s3, proxy.url, "node-0001").list_objects_v2(Bucket=B, Prefix="l/")
            snap = proxy.snapshot()
        finally:
            if proxy is not None:
                proxy.stop()
            s3.close()
    kinds = snap["kinds"]
    for kind, st in kinds.items():
        print(f"{kind:24} {st['count']:4}  status {st['status']}  ranged {st['ranged']}  "
              f"listings {st['listings']}  keys {st['keys']} (own {st['keys_own']}, "
              f"other {st['keys_other']}, none {st['keys_unowned']})")  # fmt: skip
    print("callers:", snap["callers"])
    minimum = {
        "PutObject": 6, "HeadObject": 1, "GetObject": 5, "CreateMultipartUpload": 1,
        "UploadPart": 2, "ListParts": 1, "ListMultipartUploads": 1,
        "CompleteMultipartUpload": 1, "ListObjectsV2": 4, "ListObjects": 1,
        "CopyObject": 1, "DeleteObjects": 1, "DeleteObject": 1, "HeadBucket": 1,
    }  # fmt: skip
    missing = {k: n for k, n in minimum.items() if kinds.get(k, {}).get("count", 0) < n}
    bad = {k: st["status"] for k, st in kinds.items() if {"5xx", "error"} & set(st["status"])}
    own = kinds["ListObjectsV2"]["keys_own"]
    problems = []
    if missing:
        problems.append(f"fewer requests than made: {missing}")
    if bad:
        problems.append(f"5xx answers or failures: {bad}")
    if "node-0001" not in snap["callers"] or own != 1:
        problems.append(f"per-node key not attributed (own keys {own})")
    if kinds["GetObject"]["ranged"] < 3:
        problems.append("ranged GETs not counted")
    print("\n".join(problems) or "proxy check: OK")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
