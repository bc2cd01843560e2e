"""`sync`: each iteration generates its batch with the newest weights and then trains on it — on-policy;
on rollout devices the trainers idle while the rollout runs (the actor's hybrid engine shares them)."""

from __future__ import annotations

from hybridflow.runtime.rl.modes.base import Mode


class Sync(Mode):
    """Base's defaults: sync the weights (if on rollout devices), generate, wait."""
