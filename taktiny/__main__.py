"""``python -m taktiny``: the ``taktiny`` command (``inspect``, ``diff``)."""

import sys

from ._cli import main

sys.exit(main())
