"""How the runtime executes a plan, in the rules both the runtime follows and the simulator prices —
defined here once, so that neither reads the other's code: which ops a loop issues, which passes compute
a prompt once for all of its samples, how a weight sync is bucketed, what our Megatron engine can run, and which
partial-rollout budgets an async plan can run.
Torch-free.

The Megatron rules: the planner proposes only layouts that pass them (planner/configs.py,
planner/sets.py, planner/brute.py), `check_runnable` refuses a plan that breaks them before Ray starts
(runtime/rl/plan_support.py), and the engine checks the same against megatron-core's live state
(runtime/engines/train/megatron/engine.py, megatron/model.py).

- megatron-core keeps ONE parallel state per process (tp, pp, ep: `initialize_model_parallel`), and the
  roles of one device group share their worker processes: Megatron roles colocated in a group must
  share (tp, pp, ep) — `megatron_state`, `colocation_problem`.
- megatron-core trains a MoE layer at tp > 1 only with sequence parallelism, which our engine does not
  turn on: megatron-core's local layer spec (no Transformer Engine, as in the engine's CPU tests) refuses
  sequence parallelism outright, so it could not be tested here. A trained MoE model on Megatron keeps
  tp = 1 — `moe_tp_problem`; megatron-core itself refuses it in the engine at the first training step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from hybridflow.simulator.errors import HflowError
from hybridflow.simulator.vocabulary.model import Head, ModelSpec
from hybridflow.simulator.vocabulary.parallel import ParallelConfig
from hybridflow.simulator.vocabulary.units import MiB
from hybridflow.simulator.vocabulary.workload import Workload

if TYPE_CHECKING:
    from hybridflow.simulator.vocabulary.plan import Plan

WEIGHT_SYNC_BUCKET_BYTES = 64 * MiB  # a weight sync broadcasts the model in buckets of at most this


def needs_old_logprob_pass(workload: Workload, roles: Iterable[str], kl_in_reward: bool) -> bool:
    """Whether the actor needs a forward of its own for the old log-probs (`actor_logprob`).

    Not with one PPO epoch of one mini-batch: the update then takes its own log-probs, detached, as the
    old ones — unless the run folds a KL penalty into the rewards (`kl_in_reward`: a run's settings, or
    the algorithm's defaults) and the plan has the 'ref' model it needs.
    """
    return workload.ppo_epochs > 1 or workload.mini_batches > 1 or (kl_in_reward and "ref" in set(roles))


def shares_prompts(head: Head, par: ParallelConfig, attention_window: int | None, seq_len: int) -> bool:
    """Whether the FSDP engine computes each prompt once for all of its samples in an LM's forward and
    train passes (runtime/engines/train/fsdp/shared_prompts.py): not under tensor or pipeline parallelism,
    nor on the Megatron backend, nor where a layer's sliding window is shorter than the `seq_len` columns
    of a row (the packed rows' block mask has no window), nor under Ulysses sequence parallelism (sp > 1 splits
    plain packed rows)."""
    return head == "lm" and par.tp == 1 and par.pp == 1 and par.sp == 1 and par.backend != "megatron" and (
        attention_window is None or seq_len <= attention_window)


# The rule and its fixes, for both places that refuse a plan breaking it (check_runnable and the engine).
COLOCATION_RULE = ("megatron-core keeps one parallel state per process, so colocated Megatron roles must share tp, pp "
                   "and ep: give them the same, train all but one with backend fsdp, or put them in different groups")


def megatron_state(cfg: ParallelConfig) -> tuple[int, int, int] | None:
    """The (tp, pp, ep) megatron-core's per-process parallel state holds for a training layout; None
    for a layout no Megatron engine trains (FSDP), which leaves the state free."""
    return (cfg.tp, cfg.pp, cfg.ep) if cfg.backend == "megatron" else None


def state_label(state: tuple[int, int, int]) -> str:
    tp, pp, ep = state
    return f"tp{tp}·pp{pp}·ep{ep}"


def colocation_problem(group: str, configs: Mapping[str, ParallelConfig]) -> str | None:
    """One line when the Megatron roles of one device group (role -> training layout) differ in
    (tp, pp, ep); None when they share it (or fewer than two are on Megatron)."""
    meg = {r: megatron_state(c) for r, c in configs.items() if megatron_state(c) is not None}
    if len(set(meg.values())) <= 1:
        return None
    roles = ", ".join(f"{r} {configs[r].label()}" for r in meg)
    return f"group '{group}' holds Megatron roles with different tp/pp/ep ({roles}); {COLOCATION_RULE}"


def moe_tp_problem(model: ModelSpec, cfg: ParallelConfig) -> str | None:
    """One line when a trained role's layout `cfg` trains a MoE model on Megatron at tp > 1; None otherwise.
    Forward-only roles (ref, reward) run in eval mode, where megatron-core does not ask for it."""
    if cfg.backend != "megatron" or model.experts is None or cfg.tp == 1:
        return None
    return (f"it trains MoE model {model.name} on Megatron at tp={cfg.tp} ({cfg.label()}); megatron-core trains a MoE "
            "layer at tp > 1 only with sequence parallelism, which this runtime's Megatron engine does not set: use "
            "tp=1 (pp and ep split the model instead) or backend fsdp")


def context_parallel_problem(cfg: ParallelConfig) -> str | None:
    """One line when `cfg` splits sequences on Megatron (context parallelism): priced, not run here."""
    if cfg.backend != "megatron" or cfg.sp == 1:
        return None
    return (f"{cfg.label()} splits sequences over sp={cfg.sp} ranks on Megatron (context parallelism, ring attention), "
            "which the simulator prices but this runtime does not run: megatron-core's context parallelism needs "
            "Transformer Engine's attention on CUDA; train with backend fsdp (Ulysses sp) or sp 1")


def partial_budgets(response_len: int, staleness: int) -> list[int]:
    """The partial-rollout budgets worth pricing for an async plan: the longest response cut into j rounds,
    j = 2 … k (largest first). Fewer rounds re-prefill less of each paused response; more cut its tail finer.
    Beyond k a paused response would outlive the staleness bound (check_partial_budget), and one round is no
    partial rollout at all."""
    return sorted({-(-response_len // j) for j in range(2, staleness + 1)} - {response_len}, reverse=True)


def check_partial_budget(plan: Plan, budget: int, name: str = "async_mode.partial_rollout_tokens") -> None:
    """HflowError (one line) unless `budget` (the setting `name`) is a partial-rollout budget `plan` can run: an
    async plan, below the response length, and few enough rounds that a response's first tokens stay within the
    staleness bound (the runtime regenerates one that would not, runtime/rl/partial_rollouts.py)."""
    if plan.mode != "async":
        raise HflowError(f"{name} continues responses across rounds of the async mode; the plan's mode is "
                         f"'{plan.mode}': use --mode async or drop {name}")
    n, k = plan.workload.response_len, plan.staleness
    if budget >= n:
        raise HflowError(f"{name} {budget} is not below the response length {n}, so no response would be paused: "
                         f"set it below {n} or drop it")
    if -(-n // budget) > k:
        fix = f"set {name} to at least {-(-n // k)} or raise max_staleness" if k > 1 else \
            "raise max_staleness to 2 or more"
        raise HflowError(f"a response of response_len {n} tokens takes {-(-n // budget)} rounds of {name} {budget}, "
                         f"one per iteration while the trainers are the slower side, so its first tokens would be "
                         f"more than max_staleness {k} updates old: {fix}")
