"""``python -m perfx_core`` is the ``perfx`` command."""

import sys

from .cli import main

sys.exit(main())
