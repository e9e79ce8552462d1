"""SharedAllocation: memory every rank of a node group maps, with the one
writer's fill fenced so that a failure on any rank is raised on all.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator

import numpy as np

from engram_jax.storage.base import Allocation
from engram_jax.storage.shared.group import NodeGroup
from engram_jax.storage.shared.handshake import Handshake, describe, fault_point
from engram_jax.storage.shared.processes import ProcessWatch

log = logging.getLogger(__name__)

# The fence waits for the writer to load the table, which can take minutes.
DEFAULT_FENCE_TIMEOUT_S = 3600.0


class SharedAllocation(Allocation):
    """Memory every rank of a :class:`NodeGroup` maps; rank 0 is the one writer.

    Fill it inside :meth:`writing` (the writer loads, everybody waits at the
    fence, a writer's failure is raised on every rank) before any lookup.
    Readers' ``host_array`` is read-only and :meth:`write` refuses them.
    """

    def __init__(
        self,
        *,
        group: NodeGroup,
        namespace: str,
        method: str,
        watch: dict[int, ProcessWatch] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.group = group
        self.namespace = namespace
        self.method = method
        self._fences = itertools.count()
        # The peers on this node a fence sees die, by rank (from the setup's hello).
        self._watch: dict[int, ProcessWatch] = {} if watch is None else watch
        self.fenced = False

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def is_writer(self) -> bool:
        return self.group.rank == 0

    def write(self, offset: int, data: np.ndarray) -> None:
        if not self.is_writer:
            raise PermissionError(
                f"rank {self.rank} of a shared table may not write: rank 0 is the one writer"
            )
        super().write(offset, data)

    @contextlib.contextmanager
    def writing(self, timeout_s: float | None = None) -> Iterator[bool]:
        """``with alloc.writing() as is_writer: if is_writer: fill(...)`` then a fence.

        Every rank enters; the body runs everywhere and yields whether this
        rank writes. On exit all ranks wait until the writer is done; an
        exception on any rank is raised as :class:`SharedTableError` on all.
        A ``KeyboardInterrupt`` (or other non-``Exception``) is published to
        the others, which raise at once, and re-raised here without waiting.
        """
        try:
            yield self.is_writer
        except Exception as exc:
            self.fence(error=exc, timeout_s=timeout_s)
            raise  # fence raised already; kept for type checkers
        except BaseException as exc:
            self._abandon(exc)
            raise
        self.fence(timeout_s=timeout_s)

    def _abandon(self, error: BaseException) -> None:
        """Publish ``error`` at the next fence without waiting for the others."""
        if self.closed:
            return
        step = next(self._fences)
        try:
            Handshake(self.group, self.namespace, 0.0).publish(f"fence{step}", describe(error))
        except Exception:  # the interrupt matters more than telling the peers
            log.warning("could not tell the other ranks of %s", type(error).__name__, exc_info=True)

    def fence(self, error: BaseException | None = None, timeout_s: float | None = None) -> None:
        """Publish this rank's state (``error`` or done) and wait for every rank's."""
        if self.closed:
            raise ValueError("the shared allocation is closed")
        step = next(self._fences)
        handshake = Handshake(
            self.group,
            self.namespace,
            DEFAULT_FENCE_TIMEOUT_S if timeout_s is None else timeout_s,
            watch=self._watch,
        )
        fault_point(f"fence{step}", self.rank)
        handshake.publish(f"fence{step}", None if error is None else describe(error))
        handshake.gather(f"fence{step}", cause=error)
        self.fenced = True
