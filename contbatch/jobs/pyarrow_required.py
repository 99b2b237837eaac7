"""pyarrow, imported only when a job reads or writes Parquet: it is an optional dependency
(``pip install contbatch[parquet]``), so JSONL, text and CSV jobs run without it."""

from types import ModuleType

INSTALL_HINT = "pip install contbatch[parquet]"


class MissingDependency(ImportError):
    """Parquet input or output was asked for, but pyarrow is not installed."""


def import_pyarrow() -> tuple[ModuleType, ModuleType]:
    """``pyarrow`` and ``pyarrow.parquet``; MissingDependency saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        message = f"Parquet input and output need pyarrow, which is not installed: {INSTALL_HINT}"
        raise MissingDependency(message) from exc
    return pyarrow, pyarrow.parquet
