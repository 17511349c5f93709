"""PyTorch DCP through ckptd: dcp.save / async_save / load with CkptdWriter / CkptdReader
against a real daemon, in one process and in gloo jobs of 2 and 4 ranks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="the DCP tests need torch (make venv installs a CPU build)"
)

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from ckptd.client import CheckpointNotFound, CkptdError  # noqa: E402
from ckptd.client.handle import SaveHandle  # noqa: E402
from ckptd.client.leaves.torch_tensors import dtype_names  # noqa: E402
from ckptd.client.torch import CkptdReader, CkptdWriter  # noqa: E402
from ckptd.proto import ckptd_pb2 as pb  # noqa: E402

from .conftest import Daemon, RemoteTarget  # noqa: E402
from .test_jax_multihost import free_port  # noqa: E402
from .test_remote_tier import remote_daemon  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# DCP warns that it saves "in a single process" whenever no process group is up; torch
# that complex32 is experimental whenever one is made.
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
]


def random_of(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """A tensor of dtype ``name`` with random bits (valid values for bool)."""
    dt = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = dt.itemsize
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=g)
    return raw.view(dt)


def bits(t: Any) -> Any:
    """A tensor's bytes, for bit-exact comparisons (NaN payloads included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(want: dict[str, Any], got: dict[str, Any]) -> None:
    assert want.keys() == got.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(bits(got[k]), bits(v)), k
        else:
            assert got[k] == v, k


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target: zeroed tensors, and dicts whose leaves DCP replaces."""
    return {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v)
        for k, v in state.items()
    }


def every_dtype(seed: int) -> dict[str, Any]:
    state: dict[str, Any] = {n: random_of(n, (3, 4), seed + i) for i, n in enumerate(dtype_names())}
    state["transposed"] = torch.randn(6, 4).t()  # non-contiguous
    state["sliced"] = torch.arange(40, dtype=torch.float64).reshape(8, 5)[::2, 1:4]
    state["empty"] = torch.zeros(0, 7)
    state["scalar"] = torch.tensor(3.25)
    state["param"] = torch.nn.Parameter(torch.randn(5))  # requires_grad
    state["extra"] = {"epoch": 3, "name": "every-dtype"}
    return state


def test_every_dtype_round_trips_bit_exact(daemon: Daemon) -> None:
    state = every_dtype(0)
    client = daemon.client("dcp")
    writer = CkptdWriter(client)
    dcp.save(state, checkpoint_id=5, storage_writer=writer)
    assert [(c.step, c.state) for c in client.list()] == [(5, "LOCAL")]  # wait="local"
    got = zeros_like(state)
    got["param"] = torch.nn.Parameter(torch.zeros(5))
    dcp.load(got, checkpoint_id="ckptd://dcp/5", storage_reader=CkptdReader(client))
    assert_same(state, got)
    assert got["param"].requires_grad


def test_async_save_then_load_from_another_client(daemon: Daemon) -> None:
    state = every_dtype(1)
    writer = CkptdWriter("dcp-async", socket=daemon.socket)
    try:
        fut = dcp.async_save(state, checkpoint_id=2, storage_writer=writer)
        fut.result(timeout=120)  # type: ignore[union-attr]
        assert writer.handle is not None and writer.handle.step == 2
        # Staged by the writer straight into the daemon's memory, committed as it lay.
        assert writer.handoff == "in place"
        got = zeros_like(state)
        reader = CkptdReader("dcp-async", socket=daemon.socket)  # newest step
        dcp.load(got, storage_reader=reader)
        assert reader.step == 2
        reader.close()
        assert_same(state, got)
    finally:
        writer.close()


def test_async_save_of_an_object_too_large_for_the_headroom_is_copied(daemon: Daemon) -> None:
    # A pickled object larger than the room left after the staged tensors: the part is
    # saved the plain way (copied into a lease of its own), and the staged lease given back.
    state = {"w": torch.arange(1000, dtype=torch.float32), "blob": {"b": "x" * (3 * 2**20)}}
    client = daemon.client("dcp-big")
    writer = CkptdWriter(client)
    dcp.async_save(state, checkpoint_id=1, storage_writer=writer).result(timeout=120)  # type: ignore[union-attr]
    assert writer.handoff == "copied"
    assert daemon.status().leases_held == 0
    got = {"w": torch.zeros(1000), "blob": {"b": ""}}
    dcp.load(got, checkpoint_id=1, storage_reader=CkptdReader(client))
    assert torch.equal(got["w"], state["w"]) and got["blob"]["b"] == state["blob"]["b"]


class Counter:
    """A Stateful object: DCP calls state_dict() on save and load_state_dict() on load."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.t = torch.full((2,), float(n))

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.t = sd["n"], sd["t"]


def test_model_and_adamw_through_get_and_set_state_dict(daemon: Daemon) -> None:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(3, 5)).sum().backward()
        opt.step()
    msd, osd = get_state_dict(m, opt)
    client = daemon.client("mo")
    state = {"model": msd, "optim": osd, "counter": Counter(7)}
    dcp.save(state, checkpoint_id=10, storage_writer=CkptdWriter(client))

    torch.manual_seed(1)
    m2 = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    msd2, osd2 = get_state_dict(m2, opt2)
    counter = Counter(0)
    dcp.load(
        {"model": msd2, "optim": osd2, "counter": counter},
        checkpoint_id=10,
        storage_reader=CkptdReader(client),
    )
    set_state_dict(m2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    assert counter.n == 7 and torch.equal(counter.t, torch.full((2,), 7.0))
    for a, b in zip(m.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"][0]["lr"] == 0.1
    for k, st in s1["state"].items():
        for name, v in st.items():
            assert torch.equal(v, s2["state"][k][name]), (k, name)


def test_bad_checkpoint_ids_and_missing_steps_are_clear_errors(daemon: Daemon) -> None:
    client = daemon.client("ids")
    for bad in ("ckptd://other-job/3", "s3://bucket/x", -1, 2.5):
        with pytest.raises(CkptdError, match=r"checkpoint_id|job"):
            dcp.save({"a": torch.ones(2)}, checkpoint_id=bad, storage_writer=CkptdWriter(client))
    # Errors inside DCP's phases reach the caller wrapped, with ckptd's message.
    with pytest.raises(CheckpointException, match="no ckptd step for this save"):
        dcp.save({"a": torch.ones(2)}, storage_writer=CkptdWriter(client))
    with pytest.raises(CheckpointException, match="no save of step 4") as info:
        dcp.load({"a": torch.ones(2)}, checkpoint_id=4, storage_reader=CkptdReader(client))
    assert "ids" in str(info.value)
    # A step saved with Client.save, not DCP: said so, not a pickle error.
    client.save(8, {"a": torch.ones(2).numpy()}).wait("local")
    with pytest.raises(CheckpointException, match="not saved by ckptd's DCP writer"):
        dcp.load({"a": torch.ones(2)}, checkpoint_id=8, storage_reader=CkptdReader(client))
    with pytest.raises(CheckpointNotFound):
        CkptdReader(client, 8).read_metadata(rank=0)


def test_wiped_local_tier_loads_from_the_bucket(make_daemon: Any, tmp_path: Path) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    d = remote_daemon(make_daemon, bucket)
    state = every_dtype(2)
    writer = CkptdWriter("dcp-remote", socket=d.socket, wait="durable")
    dcp.save(state, checkpoint_id=3, storage_writer=writer)
    writer.close()
    assert d.stop() == 0
    shutil.rmtree(d.root)
    d.restart()
    assert d.events_of(pb.STEP_EVENT_FETCHED) == []
    got = zeros_like(state)
    reader = CkptdReader("dcp-remote", socket=d.socket)
    dcp.load(got, checkpoint_id=3, storage_reader=reader)
    reader.close()
    assert_same(state, got)
    assert [e.step for e in d.events_of(pb.STEP_EVENT_FETCHED)] == [3]


def run_job(world: int, mode: str, socket: Path | str, step: int, expected: Path) -> list[str]:
    """``world`` worker processes of one gloo job (their outputs); fail with them (``socket``:
    comma-separated, one per rank, puts each rank on its own daemon)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.torch_dcp_worker",
                mode,
                str(rank),
                str(world),
                port,
                str(socket),
                str(step),
                str(expected),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not failed, "\n".join(f"--- rank {i}:\n{outputs[i][-4000:]}" for i in failed)
    return outputs


def test_two_ranks_save_and_load(daemon: Daemon, tmp_path: Path) -> None:
    run_job(2, "plain-save", daemon.socket, 4, tmp_path / "unused")
    (info,) = daemon.client("dcp-mp").list()
    assert (info.step, info.state) == (4, "LOCAL")
    run_job(2, "plain-load", daemon.socket, 4, tmp_path / "unused")


def test_two_ranks_async_save_in_place_despite_replicated_values(
    daemon: Daemon, tmp_path: Path
) -> None:
    # DCP writes a replicated value once, from one rank: the other rank's staged copy
    # of it is a hole its part closes before the commit (no fallback copy).
    outputs = run_job(2, "plain-async", daemon.socket, 5, tmp_path / "unused")
    assert all("handoff in place" in out for out in outputs), outputs
    SaveHandle(daemon.client("dcp-mp"), 5).wait("local", timeout=60)
    assert daemon.status().leases_held == 0  # each rank's staged lease, committed, is back
    run_job(2, "plain-load", daemon.socket, 5, tmp_path / "unused")


@pytest.mark.slow
def test_fsdp2_on_four_ranks_loads_on_two(daemon: Daemon, tmp_path: Path) -> None:
    expected = tmp_path / "expected.pt"
    run_job(4, "fsdp-save", daemon.socket, 6, expected)
    run_job(2, "fsdp-load", daemon.socket, 6, expected)


@pytest.mark.slow
def test_fsdp2_async_save_staged_in_place_loads_on_another_rank_count(
    daemon: Daemon, tmp_path: Path
) -> None:
    expected = tmp_path / "expected.pt"
    outputs = run_job(2, "fsdp-async", daemon.socket, 7, expected)
    assert all("handoff in place" in out for out in outputs), outputs
    SaveHandle(daemon.client("dcp-mp"), 7).wait("local", timeout=60)
    assert daemon.status().leases_held == 0
    run_job(4, "fsdp-load", daemon.socket, 7, expected)


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, ckptd.client, ckptd.client.distributed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_rank_saved_on_another_node_loads_from_its_part_in_the_bucket(
    make_daemon: Any, tmp_path: Path
) -> None:
    bucket = RemoteTarget("file", f"file://{tmp_path}/bucket", {})
    nodes = [remote_daemon(make_daemon, bucket, extra_args=["--node-id", f"n{i}"]) for i in (0, 1)]
    run_job(2, "plain-save", f"{nodes[0].socket},{nodes[1].socket}", 9, tmp_path / "unused")
    for d in nodes:
        SaveHandle(d.client("dcp-mp"), 9).wait("durable", timeout=120)
    # One process on node 0 loads both ranks' items: rank 1's come from n1's part.
    sys.path.insert(0, str(REPO))
    from tests.torch_dcp_worker import plain_state

    want = plain_state(0, 2, 9) | {"rank1": plain_state(1, 2, 9)["rank1"]}
    got = zeros_like(want)
    reader = CkptdReader("dcp-mp", socket=nodes[0].socket)
    dcp.load(got, checkpoint_id=9, storage_reader=reader)
    reader.close()
    assert_same(want, got)
    assert [e.step for e in nodes[0].events_of(pb.STEP_EVENT_FETCHED)] == []  # its own part
    assert (nodes[0].root / ".peers").exists()


@pytest.mark.slow
def test_async_save_with_the_process_executor(daemon: Daemon, tmp_path: Path) -> None:
    expected = tmp_path / "expected.pt"
    run_job(2, "fsdp-async-process", daemon.socket, 11, expected)
    run_job(2, "fsdp-load", daemon.socket, 11, expected)


def test_torchtitan_style_ids_name_steps_of_the_storage_job(daemon: Daemon) -> None:
    client = daemon.client("titan-ids")
    state = {"w": torch.arange(6, dtype=torch.float32)}
    # torchtitan's <folder>/step-N (any folder: the writer's job), and ckptd://<job>/step-N.
    dcp.save(state, checkpoint_id="/x/checkpoint/step-6", storage_writer=CkptdWriter(client))
    dcp.save(state, checkpoint_id="ckptd://titan-ids/step-7", storage_writer=CkptdWriter(client))
    assert [c.step for c in client.list()] == [7, 6]
    for cid in ("ckptd://titan-ids/step-6", "/elsewhere/step-7/"):
        got = {"w": torch.zeros(6)}
        dcp.load(got, checkpoint_id=cid, storage_reader=CkptdReader(client))
        assert torch.equal(got["w"], state["w"])
    for bad in ("ckptd://other/step-6", "s3://bucket/step-6", "/x/checkpoint/last"):
        with pytest.raises(CkptdError, match="checkpoint_id"):
            CkptdWriter(client).reset(bad)


def test_storage_meta_is_recorded_with_a_save_id_per_save(daemon: Daemon) -> None:
    client = daemon.client("meta")
    writer = CkptdWriter(client, step=3)  # no checkpoint_id: DCP never calls reset()
    md = dcp.save({"a": torch.ones(2)}, storage_writer=writer)
    assert md.storage_meta is not None
    assert md.storage_meta.checkpoint_id == "ckptd://meta/3"
    first = md.storage_meta.save_id
    assert first
    writer.step = 4
    second = dcp.save({"a": torch.ones(2)}, storage_writer=writer).storage_meta.save_id  # type: ignore[union-attr]
    assert second and second != first
    reader = CkptdReader(client, 3)
    stored = reader.read_metadata()
    assert stored.storage_meta is not None
    assert (stored.storage_meta.save_id, stored.storage_meta.load_id) == (first, reader.load_id)
    assert reader.load_id


def test_dcp_stream_extensions_are_refused_with_what_to_do(daemon: Daemon) -> None:
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class Rot13(StreamTransformExtension):  # ZStandard's interface (zstandard is not installed)
        @staticmethod
        def registry_name() -> str:
            return "rot13"

        @staticmethod
        def from_descriptor(version: str) -> Rot13:
            return Rot13()

        def get_descriptor(self) -> str:
            return "rot13/1"

        def transform_to(self, output: Any) -> Any:
            return output

        def transform_from(self, input: Any) -> Any:
            return input

    with pytest.raises(CkptdError, match=r"stream extensions \(Rot13\).*Drop _extensions"):
        CkptdWriter(daemon.client("ext"), _extensions=[Rot13()])
    CkptdWriter(daemon.client("ext"), _extensions=[]).close()  # none asked: fine
    # The reader takes DCP's registry (there is nothing to decode).
    CkptdReader(daemon.client("ext"), _extension_registry=object()).close()


def test_async_staging_returns_dcp_staging_and_upload_futures(daemon: Daemon) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    state = every_dtype(5)
    writer = CkptdWriter("dcp-staging", socket=daemon.socket, async_staging=True)
    try:
        response = dcp.async_save(state, checkpoint_id=9, storage_writer=writer)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=120)
        response.upload_completion.result(timeout=120)
        assert writer.handoff == "in place"
        got = zeros_like(state)
        dcp.load(
            got, checkpoint_id=9, storage_reader=CkptdReader("dcp-staging", socket=daemon.socket)
        )
        assert_same(state, got)
    finally:
        writer.close()


def test_a_ckptd_url_without_ckptds_writer_says_which_setting_saves_through_ckptd() -> None:
    """A ckptd:// checkpoint id given to DCP without CkptdWriter (torchtitan's stock
    manager with --checkpoint.folder ckptd://<job>): DCP's fsspec writer finds the
    protocol (an fsspec entry point of ckptd) and the write names the setting."""
    import torch.distributed.checkpoint as dcp

    # DCP wraps each rank's error in a CheckpointException (a BaseException).
    with pytest.raises(BaseException, match=r"override\.imports ckptd\.client\.torchtitan"):
        dcp.save({"w": torch.zeros(4)}, checkpoint_id="ckptd://nowhere/step-1")
