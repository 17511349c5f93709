"""``python -m ckptd.daemon``: the ``ckptd`` command."""

import sys

from .app.cli import main

sys.exit(main())
