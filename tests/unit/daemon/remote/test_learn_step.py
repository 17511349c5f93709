"""A step a restore asks for by number that nothing on the node knows is learnt from
its markers (remote/read.py ``learn_step``), over a ``file://`` bucket: with the
timeline its marker records, so the copy of a save a later one replaced is not taken
as the step (it was, when only the markers' names were read)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from ckptd.daemon.catalog import Catalog
from ckptd.daemon.remote import read
from ckptd.daemon.remote.backends import open_remote
from ckptd.daemon.remote.layout import marker_key

NODE = "node-a"


def test_a_replaced_saves_copy_is_not_learnt_as_the_step(tmp_path: Path) -> None:
    async def body() -> None:
        remote = open_remote(f"file://{tmp_path}/bucket", "", 2**20, 2)
        # Step 1 of timeline 0 is still in the bucket (its retract waits for the
        # bucket); timeline 2 began at step 0 and saved step 1 again, since gone.
        await remote.put_bytes(marker_key("j", 1, NODE), json.dumps({"timeline": 0}).encode())
        catalog = Catalog(NODE)
        forks = ((1, 0), (2, 0))
        catalog.discovered("j", 0, {NODE}, False, timeline=2, forks=forks)
        catalog.discovered("j", 1, {NODE}, False, timeline=0)
        again = catalog.discovered("j", 1, {NODE}, False, timeline=2, forks=forks)
        assert again is not None and catalog.replaced_numbers("j") == {1: 2}
        catalog.remote_removed(again, "evicted")
        assert catalog.get("j", 1) is None
        await read.learn_step(remote, catalog, "j", 1)
        assert catalog.get("j", 1) is None

        # Of the live timeline it is the step, with its timeline.
        later = json.dumps({"timeline": 2, "forks": [[1, 0], [2, 0]]}).encode()
        await remote.put_bytes(marker_key("j", 1, NODE), later)
        await read.learn_step(remote, catalog, "j", 1)
        st = catalog.get("j", 1)
        assert st is not None and st.timeline == 2 and NODE in st.remote_nodes

    asyncio.run(body())
