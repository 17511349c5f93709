"""How the ``ckptd`` command shows things: tables and byte progress bars (rich).

On a terminal, tables get a header rule and bold headings and progress is a live
bar; piped or redirected, tables are plain aligned columns (one line per row, never
wrapped or cut: scripts split them) and progress is a line every few seconds, so a
log of ``ckptd pull`` shows how it went without a line per part.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TextIO

from rich import box
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from ckptd.core.wire import DEFAULT_SOCKET

PLAIN_EVERY_SECONDS = 5.0
"""Without a terminal, a progress line at most this often (and one at the end)."""


def socket_arg(p: argparse.ArgumentParser) -> None:
    """The ``--socket`` option every command that talks to the daemon takes."""
    p.add_argument(
        "--socket", default=None, help=f"daemon socket (default: $CKPTD_SOCKET or {DEFAULT_SOCKET})"
    )


def human_bytes(n: float) -> str:
    """``1.5 GiB``: binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def console(file: TextIO | None = None) -> Console:
    """A console on ``file`` (stdout): styled on a terminal; otherwise no colour and
    no width limit, so a table row is always one whole line."""
    out = file or sys.stdout
    tty = out.isatty()
    return Console(
        file=out,
        highlight=False,
        soft_wrap=not tty,
        width=None if tty else 100_000,
        no_color=not tty,
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, tty: bool) -> Table:
    """A table of strings; first column bold on a terminal."""
    t = Table(
        box=box.SIMPLE_HEAD if tty else None,
        show_edge=False,
        pad_edge=False,
        header_style="bold" if tty else "",
    )
    for i, h in enumerate(headers):
        t.add_column(h, style="bold" if tty and i == 0 else "", no_wrap=True, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a table on stdout; on a terminal narrower than the table, its lines wrap
    (as plain text would) rather than rich cutting every cell short."""
    out = console()
    if out.is_terminal:
        natural = sum(max([len(h), *(len(r[i]) for r in rows)]) + 3 for i, h in enumerate(headers))
        if natural > out.width:
            out = Console(highlight=False, width=natural)
    show(table(headers, rows, tty=out.is_terminal), out)


def show(renderable: RenderableType, out: Console | None = None) -> None:
    """Print anything rich renders on ``out`` (stdout); piped, without the padding
    rich leaves at the end of lines (diffs and ``grep 'x$'`` stay clean)."""
    out = out or console()
    if out.is_terminal:
        out.print(renderable)
        return
    with out.capture() as captured:
        out.print(renderable)
    text = "\n".join(line.rstrip() for line in captured.get().splitlines())
    out.file.write(text + "\n")
    out.file.flush()


class ByteProgress:
    """Progress by bytes on stderr: ``with ByteProgress(label, total) as p: p(n)``.

    Called from one thread (the event loop) as each part lands; a rich bar with
    rate and time left on a terminal, periodic plain lines otherwise.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label, self.total, self.done = label, total, 0
        self.stream = stream or sys.stderr
        self.start = self._printed = time.monotonic()
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ByteProgress:
        if self.stream.isatty():
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=max(self.total, 1))
        return self

    def __call__(self, n: int) -> None:
        """Account for ``n`` more bytes."""
        self.done += n
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done)
            return
        now = time.monotonic()
        if now - self._printed >= PLAIN_EVERY_SECONDS:
            self._printed = now
            self._line()

    def _line(self) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"{self.label}: {human_bytes(self.done)} of {human_bytes(self.total)} "
            f"({pct:.0f}%), {human_bytes(self.done / elapsed)}/s",
            file=self.stream,
            flush=True,
        )

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif kind is None:
            self._line()  # the last line says it all arrived
