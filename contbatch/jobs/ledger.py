"""Which record ids are done (in the output already), seen in this run, or duplicated.

Memory is one set entry per id (about 70-100 bytes for an int or short string id, so
~1 GB for 10M ids); finished results themselves are never kept.
"""

from enum import Enum


class Claim(Enum):
    NEW = "new"
    DONE = "done"  # written by an earlier run: skip
    DUPLICATE = "duplicate"  # an earlier line of this input had the same id


class IdLedger:
    def __init__(self, done: dict | None = None) -> None:
        self.done = done if done is not None else {}  # ids written by earlier runs (the keys)
        self.seen: set = set()

    def claim(self, record_id: str | int) -> Claim:
        if record_id in self.seen:
            return Claim.DUPLICATE
        self.seen.add(record_id)
        if record_id in self.done:
            del self.done[record_id]  # each id lives in one place only
            return Claim.DONE
        return Claim.NEW
