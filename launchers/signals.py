"""SIGTERM / SIGINT while a job runs, as the interruption its record names (launchers.job), and the few
steps that must not be cut in two by it.

exit_on_signals turns the signals into Interrupted, raised in the main thread (Python runs a signal's
handler there, between two bytecodes, whichever thread the OS delivered the signal to). Inside
`deferred()` the handler only notes the signal and the block's end raises it: a step that hands a
resource over (local_store's listening socket passing to the rendezvous store) either completes or has
not begun when the interruption unwinds it. A per-thread signal mask cannot do this: a process-directed
signal goes to another thread (the store's own server thread), whose handler call still reaches the
main thread."""
from __future__ import annotations

import contextlib
import signal

_HELD = {"depth": 0, "pending": None}


class Interrupted(SystemExit):
    """SIGTERM / SIGINT while a job runs: its record says so, its ranks are stopped, the process
    exits 128 + signal (a resubmitted campaign runs the job again)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def interrupt(signum, frame):
    if _HELD["depth"]:
        _HELD["pending"] = signum  # raised at the end of the deferred block
        return
    raise Interrupted(signum)


def exit_on_signals() -> None:
    """Turn SIGTERM (scancel, kill, a CI timeout) and SIGINT (Ctrl-C) into Interrupted in the main
    thread, so that run_job records the job and run_local stops its ranks."""
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def pending() -> int | None:
    """The signal a deferred block noted, not yet raised."""
    return _HELD["pending"]


@contextlib.contextmanager
def deferred():
    """The block runs whole: an interruption inside it is raised when it ends (when the outermost of
    nested blocks ends), unless the block raised on its own."""
    _HELD["depth"] += 1
    try:
        yield
    finally:
        _HELD["depth"] -= 1
    if _HELD["depth"] == 0 and _HELD["pending"] is not None:
        signum, _HELD["pending"] = _HELD["pending"], None
        raise Interrupted(signum)
