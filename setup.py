"""Builds the optional C++ extension ``contbatch._C`` (see csrc/).

The package works without it (pure-PyTorch reference ops), so a failed or skipped
build never blocks installation: set CONTBATCH_NO_EXT=1 to skip it on purpose.
"""

from setuptools import setup

setup()
