"""``python -m contbatch``: the same as the ``contbatch`` command."""

import sys

from contbatch.cli import main

sys.exit(main())
