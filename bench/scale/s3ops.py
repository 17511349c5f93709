"""S3 operations of path-style requests, and the counters the proxy keeps (``proxy.py``).

:func:`classify` names a request's operation from its method, path, query and headers;
:func:`caller_of` the access key it was signed with (SigV4 or V2, header or presigned);
:class:`Counters` counts per operation, caller and key pattern, and what each LIST
response returned (entries, the calling node's own keys, other nodes' keys).
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

LISTS = {  # kind: (the query parameter of a next page, the tag of one entry)
    "ListObjectsV2": ("continuation-token", b"<Contents>"),
    "ListObjects": ("marker", b"<Contents>"),
    "ListMultipartUploads": ("key-marker", b"<Upload>"),
    "ListParts": ("part-number-marker", b"<Part>"),
}
LIST_KINDS = tuple(LISTS)
_KEY_RE = re.compile(rb"<Key>([^<]*)</Key>")
_CREDENTIAL_RE = re.compile(r"Credential=([^/,\s]+)/")
_NUMBER_RE = re.compile(r"\d+")
_IGNORED_PARAMS = ("X-Amz-", "x-amz-", "x-id", "response-", "versionId", "AWSAccessKeyId",
                   "Expires", "Signature")  # fmt: skip
"""Query parameters that do not change the operation (presigning v4 and v2, SDK hints)."""


def _plain(query: Mapping[str, str]) -> set[str]:
    return {q for q in query if not q.startswith(_IGNORED_PARAMS)}


def classify(method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> str:
    """The S3 operation of a path-style request (``/bucket/key?query``)."""
    bucket, _, key = path.lstrip("/").partition("/")
    m = method.upper()
    if not bucket:
        return "ListBuckets" if m == "GET" else "other"
    if not key:  # bucket-level
        if m == "GET":
            if "uploads" in query:
                return "ListMultipartUploads"
            if query.get("list-type") == "2":
                return "ListObjectsV2"
            sub = _plain(query) - {"prefix", "delimiter", "marker", "max-keys", "encoding-type"}
            return "ListObjects" if not sub else "GetBucket?" + ",".join(sorted(sub))
        if m == "HEAD":
            return "HeadBucket"
        if m == "POST" and "delete" in query:
            return "DeleteObjects"
        if m == "PUT":
            sub = _plain(query)
            return "CreateBucket" if not sub else "PutBucket?" + ",".join(sorted(sub))
        if m == "DELETE":
            return "DeleteBucket"
        return "other"
    copy = any(k.lower() == "x-amz-copy-source" for k in headers)
    if m == "GET":
        if "uploadId" in query:
            return "ListParts"
        sub = _plain(query) - {"partNumber"}
        return "GetObject" if not sub else "GetObject?" + ",".join(sorted(sub))
    if m == "HEAD":
        return "HeadObject"
    if m == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPartCopy" if copy else "UploadPart"
        if copy:
            return "CopyObject"
        sub = _plain(query)
        return "PutObject" if not sub else "PutObject?" + ",".join(sorted(sub))
    if m == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "other"
    if m == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    return "other"


def caller_of(headers: Mapping[str, str], query: Mapping[str, str]) -> str:
    """The access key a request was signed with (``anonymous`` if none)."""
    found = _CREDENTIAL_RE.search(headers.get("Authorization", ""))
    if found:
        return found.group(1)
    cred = query.get("X-Amz-Credential") or query.get("AWSAccessKeyId")  # presigned v4, v2
    if not cred:  # v2 header: "AWS AKID:signature"
        auth = headers.get("Authorization", "")
        cred = auth[4:].split(":", 1)[0] if auth.startswith("AWS ") else ""
    return cred.split("/", 1)[0] if cred else "anonymous"


class Counters:
    """Per-operation and per-caller counters; a node is named by ``node_re`` in keys."""

    def __init__(self, node_re: str = r"node-\d+") -> None:
        self.node_re = re.compile(rf"(?<![^/])({node_re})(?=[/.]|$)")
        self.in_flight = 0
        self.reset()

    def reset(self) -> None:
        """Zero every counter (requests in flight are counted where they end)."""
        self.since = time.time()
        self.last_activity = self.since
        self.first_request: float | None = None
        self.kinds: dict[str, dict[str, Any]] = defaultdict(_kind_stats)
        self.callers: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.patterns: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.timeline: dict[int, int] = defaultdict(int)
        self.first_get: dict[str, float] = {}

    def pattern(self, key: str) -> str:
        """``key`` with node ids, then every number, replaced by placeholders."""
        return _NUMBER_RE.sub("<n>", self.node_re.sub("<node>", key))

    def begin(self, kind: str, caller: str, key_pattern: str) -> None:
        now = time.time()
        self.in_flight += 1
        self.last_activity = now
        if self.first_request is None:
            self.first_request = now
        self.kinds[kind]["count"] += 1
        self.callers[caller][kind] += 1
        self.patterns[kind][key_pattern] += 1
        self.timeline[int(now - self.since)] += 1
        if kind == "GetObject" and caller not in self.first_get:
            self.first_get[caller] = now

    def end(self, kind: str, rec: dict[str, Any]) -> None:
        self.in_flight -= 1
        self.last_activity = time.time()
        st = self.kinds[kind]
        status = rec.get("status", 0)
        st["status"][f"{status // 100}xx" if status else "error"] += 1
        st["req_bytes"] += rec.get("req_bytes", 0)
        st["resp_bytes"] += rec.get("resp_bytes", 0)
        st["seconds"] += rec["seconds"]
        st["max_seconds"] = max(st["max_seconds"], rec["seconds"])
        for field in _SUMMED:
            st[field] += rec.get(field, 0)
        st["max_keys"] = max(st["max_keys"], rec.get("keys", 0) + rec.get("prefixes", 0))

    def list_body(self, kind: str, caller: str, body: bytes, rec: dict[str, Any]) -> None:
        """Count what one LIST response returned."""
        rec["keys"] = body.count(LISTS[kind][1])
        rec["prefixes"] = body.count(b"<CommonPrefixes>")
        rec["truncated"] = int(b"<IsTruncated>true</IsTruncated>" in body)
        if kind == "ListParts":
            return
        for raw in _KEY_RE.findall(body):
            found = self.node_re.search(raw.decode(errors="replace"))
            if found is None:
                rec["keys_unowned"] = rec.get("keys_unowned", 0) + 1
            elif found.group(1) == caller:
                rec["keys_own"] = rec.get("keys_own", 0) + 1
            else:
                rec["keys_other"] = rec.get("keys_other", 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """Everything counted since the last reset, as JSON-ready data."""
        kinds = {k: {**v, "status": dict(v["status"])} for k, v in sorted(self.kinds.items())}
        return {
            "since_unix": self.since,
            "first_request_unix": self.first_request,
            "last_activity_unix": self.last_activity,
            "in_flight": self.in_flight,
            "total": sum(v["count"] for v in kinds.values()),
            "kinds": kinds,
            "callers": {c: dict(v) for c, v in sorted(self.callers.items())},
            "patterns": {k: dict(v) for k, v in sorted(self.patterns.items())},
            "timeline": {str(s): n for s, n in sorted(self.timeline.items())},
            "first_get_unix": dict(sorted(self.first_get.items())),
        }


_SUMMED = ("ranged", "listings", "truncated", "keys", "prefixes", "keys_own", "keys_other",
           "keys_unowned", "deleted", "aborted")  # fmt: skip


def _kind_stats() -> dict[str, Any]:
    zero = dict.fromkeys(("count", "req_bytes", "resp_bytes", "max_keys", *_SUMMED), 0)
    return {**zero, "seconds": 0.0, "max_seconds": 0.0, "status": defaultdict(int)}
