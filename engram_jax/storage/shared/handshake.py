"""The handshake of a node group: each rank publishes every step under its own
key, every rank gathers all records, and a failure (or a rank seen to die, or
a bounded wait running out) is raised on all ranks alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

from engram_jax.storage.shared.errors import SharedTableError, SharedTableTimeout
from engram_jax.storage.shared.group import NodeGroup
from engram_jax.storage.shared.processes import POLL_S, ProcessWatch

# Once one rank has failed, how long to wait for the others' reports.
_GRACE_S = 2.0

# Tests only: called as hook(point, rank) at each step of the handshake.
_fault_hook: Callable[[str, int], None] | None = None


def fault_point(point: str, rank: int) -> None:
    """Where a test may inject a failure (see ``_fault_hook``)."""
    if _fault_hook is not None:
        _fault_hook(point, rank)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Handshake:
    """Per-rank records under ``namespace/phase/rank`` in the group's store."""

    def __init__(
        self,
        group: NodeGroup,
        namespace: str,
        timeout_s: float,
        watch: dict[int, ProcessWatch] | None = None,
    ) -> None:
        self.group = group
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.watch = watch if watch is not None else {}

    def _key(self, phase: str, rank: int) -> str:
        return f"{self.namespace}/{phase}/{rank}"

    def publish(self, phase: str, error: str | None, data: dict | None = None) -> None:
        record = {"ok": error is None, "error": error, "data": data or {}}
        self.group.store.set(self._key(phase, self.group.rank), json.dumps(record))

    def gather(self, phase: str, cause: BaseException | None = None) -> list[dict]:
        """Every rank's data for ``phase``; raises on all ranks if any failed or is missing."""
        deadline = time.monotonic() + self.timeout_s
        records: list[dict | None] = [None] * self.group.size
        failures: dict[int, str] = {}
        store_error: Exception | None = None

        def failed(rank: int, message: str) -> float:
            failures[rank] = message
            # The outcome is decided: give the others a short grace to report, no more.
            return min(deadline, time.monotonic() + _GRACE_S)

        for rank in range(self.group.size):
            while True:
                remaining = deadline - time.monotonic()
                wait = max(0.001, min(remaining, POLL_S))
                try:
                    raw = self.group.store.get(self._key(phase, rank), wait)
                except Exception as exc:
                    if not isinstance(exc, TimeoutError):
                        # The store itself failed (its host process died?): wait, look again.
                        store_error = exc
                        time.sleep(wait)
                    watch = self.watch.get(rank)
                    if watch is not None and not watch.alive():
                        deadline = failed(rank, f"process {watch.pid} died")
                        break
                    if remaining <= POLL_S:
                        if store_error is not None:
                            message = f"no report; the key-value store failed: {store_error}"
                        elif failures:
                            message = "no report (stopped waiting once another rank failed)"
                        else:
                            message = f"no report within {self.timeout_s:.1f} s"
                        deadline = failed(rank, message)
                        break
                    continue
                record = json.loads(raw)
                if not record["ok"]:
                    deadline = failed(rank, record["error"])
                records[rank] = record["data"]
                break
        if failures:
            pids = self.group.process_ids
            lines = "\n".join(
                f"  rank {r} (process {pids[r] if r < len(pids) else '?'}): {m}"
                for r, m in sorted(failures.items())
            )
            where = self.namespace.rsplit("/", 2)[-2] if "/" in self.namespace else self.namespace
            message = (
                f"shared table {where!r}, step {phase!r}, failed on rank(s) "
                f"{sorted(failures)}:\n{lines}"
            )
            timed_out = all(m.startswith("no report within") for m in failures.values())
            error = (SharedTableTimeout if timed_out else SharedTableError)(message, failures)
            raise error from cause
        return records  # type: ignore[return-value]

    def step(self, phase: str, work: Callable[[], dict | None]) -> list[dict]:
        """Run ``work`` here, publish its outcome, gather everybody's."""
        try:
            fault_point(phase, self.group.rank)
            data = work()
        except Exception as exc:
            self.publish(phase, describe(exc))
            self.gather(phase, cause=exc)
            raise  # gather raised; kept for type checkers
        except BaseException as exc:
            # An interrupt: tell the others so they stop now rather than at
            # their timeout, and leave at once without waiting for them.
            with contextlib.suppress(Exception):
                self.publish(phase, describe(exc))
            raise
        self.publish(phase, None, data)
        return self.gather(phase)
