"""The launcher's errors, and how it tells a rank's own failure from an echo of a peer's."""
from __future__ import annotations


class RankError(RuntimeError):
    """A rank raised (or died); ``str()`` holds the child's full traceback.

    ``rank``: the rank reported; ``ranks``: all failed ranks; ``exc_type``: the child's exception
    class name (``"NotImplementedError"``; None if it died silently); ``child_traceback``: its
    formatted traceback; ``pids``: the children's process ids, all dead by now.
    """

    def __init__(self, message, *, rank, ranks, exc_type, child_traceback, pids):
        super().__init__(message)
        self.rank, self.ranks, self.exc_type = rank, ranks, exc_type
        self.child_traceback, self.pids = child_traceback, pids


class RankTimeout(RankError, TimeoutError):
    """Some ranks had not finished at the deadline; ``ranks`` names them, ``exc_type`` is None."""


_DIST_ERRORS = ("RuntimeError", "DistBackendError", "DistStoreError", "DistNetworkError")


def _is_collective_timeout(exc_type, text: str) -> bool:
    """A rank gave up waiting for a peer (gloo: "Timed out waiting 2000ms for recv ...")."""
    return exc_type in _DIST_ERRORS and any(w in text.lower() for w in ("timed out", "timeout"))


def _is_peer_failure(exc_type, text: str) -> bool:
    """An echo of another rank's death (gloo: "Connection closed by peer")."""
    words = ("connection closed by peer", "connection reset", "broken pipe")
    return exc_type in _DIST_ERRORS and any(w in text.lower() for w in words)


def _ranks_text(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))
