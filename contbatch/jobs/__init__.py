"""Bulk generation jobs: an input file in, a results file out, resumable after any crash.

``run_job`` is the Python entry point; ``contbatch generate`` (contbatch/cli.py) the
command line. See docs/bulk_jobs.md.
"""

from contbatch.jobs.fingerprints import InputMismatch
from contbatch.jobs.output import OutputError
from contbatch.jobs.runner import JobError, JobSummary, run_job
from contbatch.jobs.settings import SettingsMismatch

__all__ = ["run_job", "JobSummary", "JobError", "OutputError", "SettingsMismatch", "InputMismatch"]
