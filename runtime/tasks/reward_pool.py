"""The user's reward and cost functions run in a pool of worker processes: in parallel, in batches, each
sample's call bounded by `scoring.timeout_s` (run config; `--reward-workers N`, `--reward-timeout S`).

    pool = ScoringPool("reward.py:score", "reward function 'reward.py:score'", ScoringConfig(workers=4, timeout_s=5))
    scores = pool.score_responses(prompts, responses, fields)   # float32 [B]; pool.timeouts: how many timed out
    pool.close()

Each worker (spawned: the driver has Ray's threads, which a fork would copy half-way) imports the function
once. A batch goes out in chunks, a few per worker; in the worker each call runs under an interval timer
whose signal stops it with an exception the user's `except Exception` cannot swallow. A call stuck where
no signal reaches it (inside C code) is caught by the driver's own deadline for the chunk: the pool's
processes are killed and started again, and every sample of that chunk counts as timed out. A timed-out
sample ends the run (one line naming it and the limit) unless `scoring.timeout_score` gives it a score;
either way the count is in the metrics (`reward/timeouts`). An exception in the user's code is the
same one line as on the driver, and `--debug` prints the traceback from the user's file.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from hybridflow.runtime.tasks.data import Prompt, prompt_preview
from hybridflow.runtime.tasks.reward_worker import init_worker, score_chunk
from hybridflow.runtime.tasks.rewards import as_score, describe_sample
from hybridflow.runtime.tasks.user_functions import user_error
from hybridflow.simulator.errors import HflowError

CHUNKS_PER_WORKER = 4
HANG_SLACK_S = 10.0  # beyond a chunk's summed timeouts, before its worker is deemed stuck outside Python


class UserTraceback(Exception):
    """The traceback of an exception in the user's function, from the worker process (`--debug` prints it)."""


class ScoringPool:
    def __init__(self, ref: str, name: str, config):
        self.ref, self.name, self.config = ref, name, config
        self.workers = max(config.workers, 1)
        self.timeouts = 0  # of the last batch
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=init_worker, initargs=(self.ref, self.name))
        return self._pool

    def _kill(self) -> None:
        """Workers stuck where no signal reaches them: killed, started again on the next batch."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, chunks: list[list], name: str) -> list:
        try:
            return [self._executor().submit(score_chunk, chunk, self.config.timeout_s) for chunk in chunks]
        except Exception as e:  # the pool could not start
            raise HflowError(f"{name}: its worker processes could not start ({type(e).__name__}: {e})") from None

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def score_responses(self, prompts: Sequence[Prompt], responses: Sequence[str],
                        fields: dict[str, Sequence] | None = None, name: str | None = None,
                        rows: Sequence[int] | None = None, source: str = "") -> torch.Tensor:
        name = name or self.name
        fields = fields or {}
        samples = [(p, r, {k: v[i] for k, v in fields.items() if v[i] is not None})
                   for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
        size = max(1, math.ceil(len(samples) / (self.workers * CHUNKS_PER_WORKER)))
        timeout_s = self.config.timeout_s
        chunks = [samples[s:s + size] for s in range(0, len(samples), size)]
        results: list[tuple] = []
        futures = self._submit(chunks, name)
        for i, chunk in enumerate(chunks):
            try:
                got = futures[i].result(timeout=len(chunk) * timeout_s + HANG_SLACK_S if timeout_s else None)
            except FutureTimeout:  # stuck where its timer cannot reach: killed, the chunks after it sent again
                self._kill()
                got = [("timeout",)] * len(chunk)
                futures[i + 1:] = self._submit(chunks[i + 1:], name)
            except Exception as e:  # a worker died (the user's code exited it, or it was killed)
                self._kill()
                raise HflowError(f"{name}: a worker process running it died ({type(e).__name__}: {e}); "
                                 "does the function exit or crash the interpreter?") from None
            results.extend(got)
            if got and got[-1][0] == "error":
                break
        return self._scores(results, prompts, responses, name, rows, source)

    def _scores(self, results, prompts, responses, name, rows, source) -> torch.Tensor:
        out, self.timeouts = [], 0
        for i, res in enumerate(results):
            where = describe_sample(i, prompts[i], None if rows is None else rows[i], source)
            if res[0] == "error":
                _, kind, text, tb = res
                raise user_error(f"{name} raised {kind} ({text}) on {where}, response "
                                 f"{prompt_preview(responses[i])!r}; fix the function",
                                 UserTraceback(tb.rstrip()))
            if res[0] == "timeout":
                self.timeouts += 1
                if self.config.timeout_score is None:
                    raise HflowError(f"{name} took more than {self.config.timeout_s:g} s on {where} and was stopped; "
                                     "allow it more (--reward-timeout S) or score such samples with "
                                     "--reward-timeout-score X")
                out.append(float(self.config.timeout_score))
                continue
            out.append(as_score(res[1], name, where))
        return torch.tensor(out, dtype=torch.float32)
