"""Completion events of the asynchronous calls (lookup_start, apply_gradients_start):
each start gets a slot number, its own or its tag's, that its done waits on; and
the size of the ticket a start returns. Shared by ops.py and training.py."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable

# uint32 words of a ticket: which call site staged the start, and which start it was.
TICKET_WORDS = 4

_counter = itertools.count()
_lock = threading.Lock()
_tag_slots: dict[Hashable, int] = {}


def slot_for(tag: Hashable | None) -> int:
    """The completion event of a start: its own, or the one every start with ``tag`` shares."""
    with _lock:
        if tag is None:
            return next(_counter)
        if tag not in _tag_slots:
            _tag_slots[tag] = next(_counter)
        return _tag_slots[tag]
