"""The ckptd node daemon: ``ckptd serve`` and the rest of the CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ckptd")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
