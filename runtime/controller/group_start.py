"""Worker groups started side by side: each goes through its start stages (WorkerGroup._stages: the
processes, the shared-storage check, the rendezvous, each role's weights) as fast as its own ranks allow,
so a run's groups start, and load their weights, at once rather than one after another."""

from __future__ import annotations

import time
import typing
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import ray

from hybridflow.runtime.controller.calls import WorkerTimeoutError


class StartingGroup(typing.Protocol):
    """What a start needs of a group (worker_group.WorkerGroup made with `start=False`): its start
    stages, their timeout and reporting, how it names a rank, and how it is killed."""

    name: str
    report_every_s: float
    on_wait: Callable[[str, float], None] | None

    def _stages(self) -> Generator[tuple[list, str], list, None]: ...

    def _stage_timeout(self, stage: str) -> float: ...

    def describe_rank(self, rank: int) -> str: ...

    def _kill(self) -> None: ...


@dataclass
class _Stage:
    """A start stage of one group under way: its refs (one per rank it waits for) and its clock."""

    refs: list
    name: str
    t0: float
    deadline: float
    report_at: float
    pending: set


def start_together(groups: Sequence[StartingGroup]) -> None:
    """Start groups made with `start=False` side by side: each goes through its start stages as fast as
    its own ranks allow, so the processes of different groups start (and load their weights) at the
    same time rather than one group after another. Each stage is bounded by its group's start timeout
    (WorkerTimeoutError); a rank that fails raises at once. On any failure every group given is killed."""
    stages: dict[StartingGroup, _Stage] = {}
    steps = {g: g._stages() for g in groups}
    owner: dict = {}  # ref -> the group whose stage waits for it

    def advance(g: StartingGroup, results: list | None) -> None:
        try:
            refs, name = steps[g].send(results)
        except StopIteration:
            del stages[g]
            return
        now = time.monotonic()
        stages[g] = _Stage(refs, name, now, now + g._stage_timeout(name), now + g.report_every_s, set(refs))
        owner.update(dict.fromkeys(refs, g))

    try:
        for g in groups:
            advance(g, None)
        while stages:
            now = time.monotonic()
            for g, st in list(stages.items()):
                if now >= st.deadline:
                    late = ", ".join([g.describe_rank(r) for r, ref in enumerate(st.refs) if ref in st.pending][:3])
                    raise WorkerTimeoutError(f"group '{g.name}': {st.name} took over {st.deadline - st.t0:.0f}s "
                                             f"(still waiting: {late}); raise --start-timeout if it is just slow")
                if now >= st.report_at:
                    st.report_at += g.report_every_s
                    if g.on_wait:
                        g.on_wait(st.name, now - st.t0)
            wake = min(min(st.deadline, st.report_at) for st in stages.values())
            pending = [ref for st in stages.values() for ref in st.refs if ref in st.pending]
            ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, wake - now))
            for ref in ready:
                g = owner.pop(ref)
                st = stages[g]
                st.pending.discard(ref)
                try:
                    ray.get(ref)  # a rank that failed raises now, not when its peers time out
                except Exception as e:
                    steps[g].throw(e)  # the stage names the role and rank, or it raises as it was
                    raise
                if not st.pending:
                    advance(g, ray.get(st.refs))
    except BaseException:
        for g in groups:
            g._kill()
        raise
