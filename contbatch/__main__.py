"""``python -m contbatch``: the same as the ``contbatch`` command."""

from contbatch.cli import run

run()
