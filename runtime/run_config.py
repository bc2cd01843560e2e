"""RunConfig: the RL hyper-parameters and inputs of a run — what a Plan does not say.

A Plan fixes the algorithm, the models, the workload shape and where everything runs; this says
what to train on (a built-in task or the user's prompt file and reward function), how to sample
and how to weigh the losses. Run-level defaults suit the tiny model on the built-in `sort` task.

The algorithm's settings (`loss`, `kl`, `advantage`, `shaping`, `lagrange`: simulator/algorithms/
settings.py) have per-algorithm defaults in its registry entry; `for_algorithm` fills every field
the config leaves unset from them (a YAML `kl: {coef: 0.02}` keeps the algorithm's KL placement
and estimator), so each default lives in one place.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, NonNegativeFloat, PositiveFloat, PositiveInt, ValidationError

from hybridflow.simulator.algorithms import RLSettings, get_algorithm, merge_settings
from hybridflow.simulator.errors import HflowError, describe_validation_error


class RunConfig(RLSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    # ---- data ----------------------------------------------------------------------------------
    task: str = "sort"  # built-in task: prompts, reward and the warm-up policy
    prompts_file: str | None = None  # JSONL or Parquet with a 'prompt' column (replaces the task's prompts)
    dataset_size: PositiveInt = 4096  # prompts drawn from the built-in task
    # ---- sampling ------------------------------------------------------------------------------
    temperature: NonNegativeFloat = 1.0  # log-probs are taken at it too (0: greedy, log-probs at 1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    # ---- optimisation --------------------------------------------------------------------------
    actor_lr: PositiveFloat = 2e-4
    critic_lr: PositiveFloat = 1e-3
    grad_clip: NonNegativeFloat = 1.0
    value_clip: PositiveFloat | None = 0.2
    # ---- checkpoints ---------------------------------------------------------------------------
    save_every: PositiveInt = 1  # iterations between checkpoints (with a checkpoint dir)

    def for_algorithm(self, algorithm: str, has_ref: bool = True) -> RunConfig:
        """This config with `algorithm`'s default settings under every RL field it leaves unset; without a
        reference model (`has_ref` False) the KL is off unless the config sets its coefficient."""
        algo = get_algorithm(algorithm)
        try:
            merged = merge_settings(algo.defaults, self)
        except ValidationError as e:
            raise HflowError(describe_validation_error(e, f"run config for {algorithm}")) from None
        update = {name: getattr(merged, name) for name in RLSettings.model_fields}
        if not has_ref and "coef" not in (self.kl.model_fields_set if "kl" in self.model_fields_set else set()):
            update["kl"] = merged.kl.model_copy(update={"coef": 0.0})
        return self.model_copy(update=update)
