"""``python -m modeling_dsv41.cli``: the ``dsv41`` command."""

import sys

from .commands import main

sys.exit(main())
