"""``python -m perfx_gui``: the same as the ``perfx-gui`` script."""

from .app import main

raise SystemExit(main())
