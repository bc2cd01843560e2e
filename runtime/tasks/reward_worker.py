"""What a reward pool's worker process runs (runtime/tasks/reward_pool.py): the user's function, imported
once, called on a chunk of samples, each call under an interval timer. Torch-free, so a worker starts in
the time its user's module takes to import."""

from __future__ import annotations

import signal
import traceback

from hybridflow.runtime.tasks.user_functions import load_function

_FN = None  # the function, in a worker process


class _SampleTimeout(BaseException):
    """Raised in a worker by its timer: a BaseException, so the user's `except Exception` lets it through."""


def _on_timer(signum, frame):
    raise _SampleTimeout


def init_worker(ref: str, what: str) -> None:
    global _FN
    _FN = load_function(ref, what)
    signal.signal(signal.SIGALRM, _on_timer)


def score_chunk(samples: list[tuple[object, str, dict]], timeout_s: float | None) -> list[tuple]:
    """Per sample ("ok", value) or ("timeout",); at the first exception ("error", type, text, traceback)
    and nothing after it."""
    out: list[tuple] = []
    for prompt, response, extra in samples:
        try:
            try:
                if timeout_s:
                    signal.setitimer(signal.ITIMER_REAL, timeout_s)
                value = _FN(prompt, response, **extra)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SampleTimeout:
            out.append(("timeout",))
            continue
        except Exception as e:
            text = str(e).splitlines()[0] if str(e) else ""
            frames = e.__traceback__.tb_next  # from the user's function down (this file's frame left out)
            out.append(("error", type(e).__name__, text, "".join(traceback.format_exception(type(e), e, frames))))
            break
        try:
            out.append(("ok", value if isinstance(value, (int, float, str, bytes)) else float(value)))
        except (TypeError, ValueError):
            out.append(("ok", repr(value)))
    return out
