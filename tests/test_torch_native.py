"""torch tensors in Client.save / restore, without DCP: every dtype, parameters, strided
and empty tensors; restored as torch tensors over the restored memory, or copied in
place into a model's and an optimizer's state dicts (training goes on bit-identical)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the torch tests need torch (make venv installs a CPU build)"
)

from ckptd.core.errors import InvalidArgument  # noqa: E402

from .conftest import Daemon  # noqa: E402
from .test_torch_dcp import assert_same, every_dtype  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def test_every_dtype_comes_back_as_torch_tensors_bit_exact(daemon: Daemon) -> None:
    state = every_dtype(1)
    client = daemon.client("native")
    client.save(1, state).wait("local")
    got, _ = client.restore(step=1)
    assert_same(state, got)
    assert all(isinstance(got[k], torch.Tensor) for k in state if k != "extra")
    # Views of the restored memory, writable, and not of the saved tensors'.
    got["float32"].add_(1)
    assert not torch.equal(got["float32"], state["float32"])
    again, _ = client.restore(step=1)
    assert torch.equal(again["float32"], state["float32"])  # the checkpoint is unchanged


def test_a_mixed_tree_keeps_numpy_numpy_and_torch_torch(daemon: Daemon) -> None:
    tree = {"np": np.arange(4.0), "pt": torch.arange(4.0), "n": [np.int8(3), torch.tensor(2)]}
    client = daemon.client("mixed")
    client.save(1, tree).wait("local")
    got, _ = client.restore()
    assert type(got["np"]) is np.ndarray and isinstance(got["pt"], torch.Tensor)
    assert isinstance(got["n"][0], np.generic) and isinstance(got["n"][1], torch.Tensor)
    assert np.array_equal(got["np"], tree["np"]) and torch.equal(got["pt"], tree["pt"])


def make(seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def train(model: Any, opt: Any, sched: Any, offset: int, steps: int) -> list[float]:
    losses = []
    for i in range(offset, offset + steps):
        g = torch.Generator().manual_seed(i)  # the data at offset i
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(torch.nn.functional.dropout(x, 0.1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def checkpoint(model: Any, opt: Any, sched: Any, offset: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "data_offset": offset,
    }


def test_model_optimizer_scheduler_and_rng_load_in_place_and_train_on_bit_identical(
    daemon: Daemon,
) -> None:
    model, opt, sched = make(0)
    train(model, opt, sched, 0, 5)
    client = daemon.client("inplace")
    client.save(5, checkpoint(model, opt, sched, 5)).wait("local")
    want = train(model, opt, sched, 5, 6)  # the run that never stopped

    fresh, fopt, fsched = make(1)  # other weights, an empty optimizer state
    train(fresh, fopt, fsched, 100, 1)  # so the optimizer holds state tensors to load into
    weight = fresh[0].weight
    target = checkpoint(fresh, fopt, fsched, 0)
    got, _ = client.restore(target=target)
    assert got["model"]["0.weight"] is target["model"]["0.weight"]  # loaded in place
    assert torch.equal(weight.detach(), got["model"]["0.weight"])
    fopt.load_state_dict(got["optim"])
    fsched.load_state_dict(got["sched"])
    torch.set_rng_state(got["rng"]["torch"])
    random.setstate(got["rng"]["python"])
    assert got["data_offset"] == 5 and weight.requires_grad
    assert train(fresh, fopt, fsched, got["data_offset"], 6) == want
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_tensors_ckptd_cannot_store_are_refused_with_their_path(daemon: Daemon) -> None:
    client = daemon.client("refused")
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(InvalidArgument, match=r"at \['layer'\]\['w'\].*sparse.*dense"):
        client.save(1, {"layer": {"w": sparse}})
    assert client.list() == []


def test_the_readme_snippet_resumes_a_fresh_model_and_optimizer(daemon: Daemon) -> None:
    model, optimizer, _ = make(0)
    constant = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    train(model, optimizer, constant, 0, 3)
    client = daemon.client("snippet")
    step = 3
    client.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step})
    client._saver.last.wait("local")  # type: ignore[union-attr]
    rng = torch.get_rng_state()  # (dropout's generator: not what this snippet is about)
    want = train(model, optimizer, constant, 3, 4)

    model, optimizer, _ = make(1)  # a new process: fresh model, empty optimizer
    ckpt, _ = client.restore(target={"model": model.state_dict(), "optim": None, "step": None})
    optimizer.load_state_dict(ckpt["optim"])
    assert ckpt["step"] == 3
    constant = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    torch.set_rng_state(rng)
    assert train(model, optimizer, constant, 3, 4) == want
