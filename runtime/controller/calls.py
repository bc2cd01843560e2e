"""Futures of worker-group calls, futures as inputs of other calls, and the errors a call raises.

`CallFuture.get()` waits for every rank of the call. It watches all ranks at once, so when a
worker process dies the driver learns it as soon as Ray does (about a second) instead of waiting
for the other ranks, which may be stuck in a collective with the dead one: it raises one
`WorkerDiedError` naming the role, the rank and the node, after shutting every live worker
group down. A method that raises gives `WorkerCallError` with the worker's exception as cause.

A CallFuture passed as an argument of another call is not fetched by the driver: each rank of
the receiving group gets a `LazyArg` (the object refs of the producing ranks plus both
protocols), fetches the outputs itself, gathers them with the producer's protocol and takes its
own share with the consumer's protocol.
"""

from __future__ import annotations

import re
import time
import typing
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

from hybridflow.runtime.controller.kill_evidence import signal_cause
from hybridflow.runtime.controller.protocols import Protocol, merge_info
from hybridflow.simulator.vocabulary.parallel import ParallelConfig


class CallGroup(typing.Protocol):
    """What a call's future needs of the worker group that made it (worker_group.WorkerGroup): its name
    and call timeout, and how it names a rank and turns a lost or late rank into the error to raise."""

    name: str
    call_timeout: float | None

    def describe_rank(self, rank: int) -> str: ...

    def rank_on_lost_node(self) -> int | None: ...

    def fail(self, role: str, rank: int, method: str, err: BaseException,
             upstream: bool = False) -> WorkerDiedError: ...

    def time_out(self, late: list[tuple[str, int, str]], seconds: float) -> WorkerTimeoutError: ...


class WorkerDiedError(RuntimeError):
    """A worker process died during a call; the run's worker groups have been shut down."""


MEMORY_HINT = "give each worker more memory: fewer devices per node, a smaller micro-batch, or offload"


def death_cause(err: BaseException, pid: int | None = None, on_this_machine: bool = False) -> str:
    """Why a worker process died, in a few words, from the evidence: Ray's memory monitor killed it (its
    error says so), the kernel's OOM killer did (a record for `pid` in this machine's kernel log:
    kill_evidence.py), a signal did (it exited with no error of its own, and no OOM record), or it was
    killed on purpose."""
    text = str(err)
    if isinstance(err, OutOfMemoryError) or "running low on memory" in text:
        used = re.search(r"was ([\d.]+ ?GB / [\d.]+ ?GB)", text)
        return (f"was killed by Ray's memory monitor: its node ran out of memory ({used.group(1) + ' used; ' if used else ''}"
                f"{MEMORY_HINT})")
    if "connection error" in text or "exits unexpectedly" in text or "SIGKILL" in text:
        cause = signal_cause(pid, on_this_machine)
        return f"{cause}; {MEMORY_HINT}" if "out-of-memory killer (kernel log" in cause else cause
    if "actor is killed" in text or "ray.kill" in text:
        return "was killed (ray.kill or `ray stop`)"
    first = (text.strip().splitlines() or [type(err).__name__])[0][:200]
    return f"died ({first})"


class WorkerCallError(RuntimeError):
    """A worker method raised; `__cause__` is the worker's exception."""


class WorkerTimeoutError(TimeoutError):
    """A call did not finish within the timeout given to `get`."""


@dataclass
class LazyArg:
    """One rank's share of another call's result, resolved inside the worker."""

    refs: list  # object refs of the producer's collect ranks, in order
    source: Protocol
    source_parallel: ParallelConfig
    target: Protocol
    target_parallel: ParallelConfig
    rank: int

    def resolve(self) -> tuple[Any, dict]:
        outputs = ray.get(self.refs)
        value = self.source.gather([v for v, _ in outputs], self.source_parallel, outputs[0][1])
        parts, info = self.target.split(value, self.target_parallel)
        return parts[self.rank], info


def resolve_lazy(args: tuple, kwargs: dict, info: dict) -> tuple[tuple, dict, dict]:
    """Replace LazyArgs by values (in the worker); merge their split info into the call's."""
    infos = [info]

    def one(v):
        if isinstance(v, LazyArg):
            v, i = v.resolve()
            infos.append(i)
        return v

    args = tuple(one(a) for a in args)
    kwargs = {k: one(v) for k, v in kwargs.items()}
    return args, kwargs, merge_info(infos)


class CallFuture:
    """The pending result of one driver call on a worker group (one object ref per rank)."""

    def __init__(self, group: CallGroup, role: str, method: str, protocol: Protocol,
                 parallel: ParallelConfig, refs: list, inputs: tuple[CallFuture, ...] = ()):
        self.group, self.role, self.method, self.inputs = group, role, method, inputs
        self.protocol, self.parallel, self.refs = protocol, parallel, refs
        self._result: tuple[bool, Any] | None = None
        self._outputs: dict[int, Any] = {}

    def lazy_parts(self, target: Protocol, target_parallel: ParallelConfig) -> tuple[list[LazyArg], dict]:
        """This future as an argument of a call on `target_parallel` ranks (see module doc)."""
        collect = [self.refs[r] for r in self.protocol.collect_ranks(self.parallel)]
        return [LazyArg(collect, self.protocol, self.parallel, target, target_parallel, r)
                for r in range(target_parallel.world_size)], {}

    def done(self) -> bool:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout: float | None = None) -> Any:
        """Wait for every rank and gather the result through the method's protocol."""
        return get_all([self], timeout)[0]

    def _take(self, ref, value_or_error) -> None:
        """Record one rank's output; turn a failure into the error the driver raises."""
        rank = self.refs.index(ref)
        e = value_or_error
        if isinstance(e, RayTaskError):  # checked first: Ray's wrapper may also subclass the cause's type
            if isinstance(e.cause, RayActorError):  # an input came from a worker that died: name that one
                for src in self.inputs:
                    src._raise_if_dead()
                raise self.group.fail(self.role, rank, self.method, e.cause, upstream=True) from None
            # A peer that vanished (its process or node lost) breaks this rank's collective ("Connection
            # closed by peer"): name the peer, not the survivor that noticed.
            self._raise_if_dead()
            lost = self.group.rank_on_lost_node()
            if lost is not None:
                raise self.group.fail(self.role, lost, self.method, e.cause) from None
            text = str(e.cause).strip()
            msg = text.splitlines()[-1] if text else ""
            raise WorkerCallError(f"'{self.role}.{self.method}' failed on {self.group.describe_rank(rank)}: "
                                  f"{type(e.cause).__name__}: {msg}") from e.cause
        if isinstance(e, RayActorError):
            raise self.group.fail(self.role, rank, self.method, e) from None
        if isinstance(e, BaseException):
            raise e
        self._outputs[rank] = value_or_error

    def _raise_if_dead(self, wait_s: float = 5.0) -> None:
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                if not isinstance(e, RayTaskError):
                    self._take(ref, e)
            except RayTaskError:
                pass

    def _finish(self) -> None:
        collect = self.protocol.collect_ranks(self.parallel)
        info = self._outputs[collect[0]][1]
        value = self.protocol.gather([self._outputs[r][0] for r in collect], self.parallel, info)
        self._result = (True, value)

    def __repr__(self) -> str:
        return f"CallFuture({self.group.name}.{self.role}.{self.method}, {len(self.refs)} ranks)"


def get_all(futures: list[CallFuture], timeout: float | None = None) -> list[Any]:
    """Results of several futures (e.g. calls overlapping on disjoint groups). All their ranks are
    watched together, so a worker that dies in any of them is reported at once. Without `timeout`,
    the groups' call timeout applies: past it every group is shut down and the late ranks named."""
    limits = [f.group.call_timeout for f in futures if f.group.call_timeout]
    enforce = timeout is None and bool(limits)
    if enforce:
        timeout = min(limits)
    deadline = None if timeout is None else time.monotonic() + timeout
    owner = {ref: f for f in futures if f._result is None for ref in f.refs if f.refs.index(ref) not in f._outputs}
    pending = list(owner)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            if enforce:
                first = owner[pending[0]]
                raise first.group.time_out(sorted({(owner[r].role, owner[r].refs.index(r), owner[r].method)
                                                   for r in pending if owner[r].group is first.group}), timeout)
            late = sorted({f"'{owner[r].role}.{owner[r].method}' rank {owner[r].refs.index(r)}" for r in pending})
            raise WorkerTimeoutError(f"calls did not finish in {timeout}s; still running: {', '.join(late)}")
        for ref in ready:
            try:
                value = ray.get(ref)
            except (RayActorError, RayTaskError) as e:
                value = e
            owner[ref]._take(ref, value)
    for f in futures:
        if f._result is None:
            f._finish()
    return [f._result[1] for f in futures]
