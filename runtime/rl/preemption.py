"""SIGTERM, a job scheduler's notice before it kills a job: the run finishes the step it is in, saves a
checkpoint, and ends with exit code 143 (PreemptedError), all within `cluster.preempt_grace_s`.

The handler only notes the time and arms an alarm at the end of the grace; the trainer's loop looks
at the note after each step (`pending`). If the alarm fires first, whatever the driver waits on then
(the step, the save) is abandoned by raising PreemptedError from the handler: the last complete
checkpoint stands, and a save cut short has no manifest, so no resume takes it. The handler may fire
inside library code that wraps what it raises (Ray's deserialisation does), so it also notes that the
grace ran out (`expired`) and the trainer raises `abandoned()` for whatever reached it.

`ray.init` installs its own SIGTERM handler (`sys.exit(15)`, printed as Ray's signal dump), so the
trainer installs this one after Ray is up. Only the main thread can install handlers; elsewhere
(a trainer driven from a thread) SIGTERM keeps whatever handler the process has.
"""

from __future__ import annotations

import signal
import threading
import time

from hybridflow.simulator.errors import PreemptedError


class Preemption:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.since: float | None = None  # monotonic time SIGTERM came
        self.expired = False  # the grace ran out and the alarm abandoned what the driver was doing
        self.where = "before the first iteration"  # what the driver was doing, for the line
        self._previous = None  # the handler before ours, back once the trainer shuts down

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            if self._previous is None and previous != self._on_sigterm:
                self._previous = previous

    def _on_sigterm(self, signum, frame) -> None:
        if self.since is not None:
            return  # a second notice changes nothing: the grace already runs
        self.since = time.monotonic()
        signal.signal(signal.SIGALRM, self._on_deadline)
        signal.setitimer(signal.ITIMER_REAL, self.grace_s)

    def _on_deadline(self, signum, frame) -> None:
        self.expired = True
        raise self.abandoned()

    def abandoned(self) -> PreemptedError:
        return PreemptedError(f"preempted (SIGTERM): the grace of {self.grace_s:g} s ran out {self.where}, which was "
                              "abandoned; the last complete checkpoint stands (continue with --resume); "
                              "--preempt-grace S gives more time")

    @property
    def pending(self) -> bool:
        return self.since is not None

    def left_s(self) -> float:
        return self.grace_s - (time.monotonic() - self.since) if self.since is not None else self.grace_s

    def disarm(self) -> None:
        if self.since is not None and threading.current_thread() is threading.main_thread():
            signal.setitimer(signal.ITIMER_REAL, 0)

    def uninstall(self) -> None:
        """The alarm off and SIGTERM's handler from before `install` back."""
        self.disarm()
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
