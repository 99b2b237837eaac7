"""Bridges to the tools contbatch's users already work in.

Each bridge imports its tool lazily, only when its module is imported, so contbatch
itself never needs them: ``contbatch.integrations.lm_eval`` (pip install contbatch[eval])
and ``contbatch.integrations.ray`` (pip install contbatch[ray]).
"""
