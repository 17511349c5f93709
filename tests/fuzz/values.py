"""The hostile (and a few valid) values the fuzz strategies draw from."""

from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor

FD = FieldDescriptor

WAIT_FIELDS = frozenset({"wait_seconds", "timeout_seconds"})
"""Fields that make the daemon wait: valid values stay small so cases stay fast."""
PATH_FIELDS = frozenset({"path", "directory"})
LONG_WAIT = 5.0
"""A wait field above this may legitimately outlast the client's deadline."""

INT_RANGES: dict[int, tuple[int, int]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
INT_EDGES = [0, 1, -1, 2, 127, 128, 255, 256, 4095, 4096, 65535, 65536, 65537]
INT_EDGES += [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62 - 1, 2**62, 2**63 - 1, 2**64 - 1]
INT_EDGES += [-(2**31), -(2**62), -(2**63)]

HOSTILE_STRINGS = [
    "",
    " ",
    ".",
    "..",
    "...",
    "/",
    "//",
    "\\",
    "a/b",
    "../x",
    "x/../..",
    "/abs/path",
    "/etc/passwd",
    "a\x00b",
    "\x00",
    "\n",
    "a\x7fb",
    "-",
    "--help",
    "*",
    "?",
    "[",
    "a*",
    ".staging",
    ".cache",
    ".ckptd-x",
    "__metadata__",
    "x" * 128,
    "x" * 129,
    "x" * 200,
    "x" * 255,
    "x" * 256,
    "x" * 4096,
    "é" * 64,
    "é" * 65,
    "é" * 128,
    "日本語のジョブ",
    "\u202eevil",
    "\ufeffbom",
    "emoji-🎉",
    "%s%n",
    "{}",
    "'; DROP TABLE",
    "CON",
    "job name with spaces",
]

HOSTILE_DOUBLES = [
    math.nan,
    math.inf,
    -math.inf,
    -0.0,
    -1.0,
    -1e308,
    5e-324,
    1e-300,
    0.0,
    1e308,
    2.0**63,
]
HUGE_WAIT = 1e308

_DEEP = 100_000
HOSTILE_JSON = [
    "",
    "{",
    "[",
    "nul",
    "NaN",
    "Infinity",
    "1e999",
    "-1e999",
    "null",
    "[]",
    "0",
    '"text"',
    "true",
    '{"a": 1, "a": 2}',
    '"\\ud800"',
    '{"k": "\\ud800"}',
    '{"\\ud800": 1}',
    '{"k": "\\u0000"}',
    '{"k": 1e999}',
    '{"k": NaN}',
    "[" * 1000 + "]" * 1000,
    "[" * _DEEP + "]" * _DEEP,
    '{"a":' * 5000 + "1" + "}" * 5000,
    '{"a":' * _DEEP + "1" + "}" * _DEEP,
    "[" * _DEEP,
    '{"big": "' + "x" * 2**20 + '"}',
    '{"n": ' + "9" * 5000 + "}",
    "\ufeff{}",
    "{} trailing",
]

HOSTILE_DTYPES = [
    "",
    "O",
    "object",
    "V0",
    "V4294967296",
    "S0",
    "<U0",
    "f8" * 100,
    "float32,float32",
    "(2,3)f4",
    "int4",
    "M8[ns]",
    "descr:",
    "descr:[]",
    "descr:{}",
    'descr:[["a", "<f4", [4294967296, 4294967296]]]',
    'descr:[["a", "O"]]',
    "descr:" + "[" * _DEEP + "]" * _DEEP,
    "descr:" + "[" * 2000 + "]" * 2000,
]
VALID_DTYPES = {"<f4": 4, "<i8": 8, "|u1": 1, "<f2": 2, "bfloat16": 2, "<c16": 16}
UNKNOWN_ENUMS = [-1, 7, 19, 99, 2**31 - 1, -(2**31)]
HOLDER_VALUES = ["", "x", "../../etc/passwd", "ckptd-client-1", "a" * 300, "/dev/shm/x", ".."]
