"""Each configuration key is declared once, in the option group of the tier that
uses it; the flat ``Config`` only composes the groups, and the composition root
cuts a loaded configuration back into them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ckptd.daemon.app import config
from ckptd.daemon.app.config_fields import GROUPS, Config
from ckptd.daemon.app.options import Options


def test_every_key_is_declared_once_in_one_group_and_config_declares_none() -> None:
    declared = [f.name for g in GROUPS for f in dataclasses.fields(g)]
    assert len(declared) == len(set(declared))  # no key in two groups
    assert declared == [f.name for f in dataclasses.fields(Config)]
    assert "__annotations__" not in vars(Config) or not vars(Config)["__annotations__"]
    texts = config.field_texts()
    assert all(texts[name] for name in declared)  # each with its documentation
    tiers = {g.__module__.split(".")[2] for g in GROUPS}
    assert tiers == {"app", "local", "remote", "peer", "lifecycle", "api"}


def test_a_loaded_configuration_reaches_each_tier_as_its_own_group(tmp_path: Path) -> None:
    cfg = config.load(
        None,
        env={"CKPTD_PEER_IDLE_SECONDS": "400", "CKPTD_PEER_TOKEN_FILE": "/t"},
        flags={"root": str(tmp_path), "local_floor": "2GiB", "remote": "file:///b", "peers": "h:1"},
    )
    opts = Options.of(cfg)
    assert opts.local.root == tmp_path and opts.local.local_floor.text == "2GiB"
    assert opts.remote.remote == "file:///b" and opts.peer.peer_idle_seconds == 400.0
    assert opts.peer.enabled and not opts.peer.serves and opts.api.socket_gid == -1
    for group in (opts.serve, opts.local, opts.remote, opts.peer, opts.lifecycle, opts.api):
        for f in dataclasses.fields(group):
            assert getattr(group, f.name) == getattr(cfg, f.name)
