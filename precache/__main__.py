"""``python -m precache`` is the ``precache`` command."""

import sys

from precache.cli import main

sys.exit(main())
