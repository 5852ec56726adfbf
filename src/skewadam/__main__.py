"""``python -m skewadam ...``: the same as the ``skewadam`` command (`skewadam.cli`)."""

import sys

from .cli import main

sys.exit(main())
