"""Pytree nodes without jax (NamedTuples, dataclasses of numpy leaves), and specs
written before named nodes existed: they still restore, into the new types too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from ckptd.client import TreeMismatch
from ckptd.client.tree.spec import flatten, unflatten

from .conftest import Daemon

REPO = Path(__file__).resolve().parent.parent


class Moments(NamedTuple):
    count: np.ndarray
    mu: dict[str, np.ndarray]


# A spec and arrays as a client before named nodes wrote them (a NamedTuple was a tuple).
OLD_SPEC = {
    "dict": [
        ["w", {"array": "w"}],
        [
            "opt",
            {
                "tuple": [
                    {"array": "opt.0", "scalar": True},
                    {"dict": [["w", {"array": "opt.1.w"}]]},
                ]
            },
        ],
        ["steps", {"list": [{"value": 1}, {"bigint": str(2**70)}, {"value": None}]}],
    ]
}
OLD_ARRAYS = {"w": np.arange(3.0), "opt.0": np.array(4, np.int32), "opt.1.w": np.ones(3)}


def test_old_specs_restore_as_saved_and_into_named_targets() -> None:
    plain = unflatten(OLD_SPEC, OLD_ARRAYS)
    assert plain["opt"][0] == 4 and isinstance(plain["opt"], tuple)
    assert plain["steps"] == [1, 2**70, None]
    target = {"w": np.zeros(3), "opt": Moments(np.int32(0), {"w": np.zeros(3)}), "steps": [0, 0, 0]}
    back = unflatten(OLD_SPEC, OLD_ARRAYS, target=target)
    assert isinstance(back["opt"], Moments) and back["opt"].count == 4
    assert np.array_equal(back["opt"].mu["w"], np.ones(3)) and back["steps"][1] == 2**70


def test_named_nodes_without_a_target_are_dicts_by_field() -> None:
    tree = {"opt": Moments(np.array(1), {"w": np.ones(2)}), "empty": ()}
    spec, arrays = flatten(tree)
    assert [k for k, _ in arrays] == ["opt.count", "opt.mu.w"]
    spec = json.loads(json.dumps(spec))
    assert spec["dict"][0][1]["type"].endswith("Moments")
    plain = unflatten(spec, dict(arrays))
    assert set(plain["opt"]) == {"count", "mu"} and plain["empty"] == ()
    with pytest.raises(TreeMismatch, match=r"no entry 'mu' at \['opt'\]"):
        unflatten(spec, dict(arrays), target={"opt": {"count": np.array(0)}, "empty": ()})
    with pytest.raises(TreeMismatch, match=r"at \['opt'\] the checkpoint has 2 children"):
        unflatten(spec, dict(arrays), target={"opt": (np.array(0),), "empty": ()})


WORKER = """
import dataclasses, json, sys
from typing import NamedTuple
sys.modules["jax"] = None  # any import of jax now fails: this is a numpy-only program
import numpy as np
from ckptd.client import Client, TreeMismatch

class Adam(NamedTuple):
    count: np.ndarray
    mu: dict
    nu: dict

@dataclasses.dataclass(frozen=True)
class State:
    params: dict
    opt: Adam
    rng: dict
    name: str = "mlp"

rng = np.random.default_rng(0)
params = {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": np.zeros(2, np.float32)}
state = State(params, Adam(np.int32(5), params, {"w": params["w"] ** 2, "b": params["b"]}),
              rng.bit_generator.state)
client = Client("np-tree", sys.argv[1])
client.save(1, state).wait("local", 60)
target = State(
    {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)},
    Adam(np.int32(0), {"w": None, "b": None}, {"w": None, "b": None}),
    None, "other")
back, _ = client.restore(target=target)
assert type(back) is State and type(back.opt) is Adam and back.name == "mlp"  # a field: saved
assert back.opt.count == 5 and np.array_equal(back.opt.nu["w"], params["w"] ** 2)
assert back.rng == state.rng and np.array_equal(back.params["w"], params["w"])
plain, _ = client.restore()
try:
    client.restore(target=dataclasses.replace(target, params={"w": np.zeros((2, 2))}))
except TreeMismatch as exc:
    err = str(exc)
print(json.dumps({"plain": sorted(plain), "opt": sorted(plain["opt"]), "err": err,
                  "jax": sys.modules["jax"] is None}))
client.close()
"""


def test_numpy_only_program_saves_and_restores_named_nodes(daemon: Daemon, tmp_path: Path) -> None:
    script = tmp_path / "numpy_only.py"
    script.write_text(textwrap.dedent(WORKER))
    proc = subprocess.run(
        [sys.executable, str(script), str(daemon.socket)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"] == ["name", "opt", "params", "rng"] and out["opt"] == ["count", "mu", "nu"]
    assert "'params'" in out["err"] and "'b'" in out["err"] and out["jax"] is True
