"""What each worker group of a Plan runs, and its start: the roles' worker classes and settings
(RoleSpec), the models' folders (the built-in policy warmed up the first time), the rollout engine's
settings, then every group's processes launched at once (controller/group_start.py).

The Trainer (rl/trainer.py) owns the groups once started; this module only builds them.
"""

from __future__ import annotations

from hybridflow.runtime.controller.locations import Location
from hybridflow.runtime.controller.resource_pool import ResourcePool, place_pool
from hybridflow.runtime.controller.storage import model_folder, output_markers
from hybridflow.runtime.controller.worker_group import RoleSpec, WorkerGroup, start_together
from hybridflow.runtime.engines.rollout.base import RolloutSettings
from hybridflow.runtime.engines.rollout.generation import SamplingParams
from hybridflow.runtime.rl.plan_support import role_weights
from hybridflow.runtime.rl.rollout import start_rollout_group
from hybridflow.runtime.rl.run_config import RunConfig
from hybridflow.runtime.rl.run_events import RunEvents
from hybridflow.runtime.tasks.builtin import get_task
from hybridflow.runtime.tasks.model_tokenizer import load_tokenizer
from hybridflow.runtime.tasks.policy_cache import cached_policy, check_warmup_shape, warmup_cost
from hybridflow.runtime.tasks.tokenizer import CharTokenizer, Tokenizer
from hybridflow.runtime.tasks.warmup import warm_policy
from hybridflow.runtime.workers.common import UpdateSettings
from hybridflow.runtime.workers.policy import PolicyObjective, PolicyWorker
from hybridflow.runtime.workers.value import ValueWorker
from hybridflow.simulator.vocabulary.model import ModelSpec
from hybridflow.simulator.vocabulary.plan import Plan
from hybridflow.simulator.vocabulary.roles import ROLLOUT, TRAINED_ROLES


class WorkerSpecs:
    """A Plan's worker groups as the run config and the actor's tokenizer set them up."""

    def __init__(self, plan: Plan, config: RunConfig, events: RunEvents):
        self.plan, self.config, self.events = plan, config, events
        self.reward_example = get_task(config.data.task).reward_function
        self.tok = self._tokenizer()

    def _tokenizer(self) -> Tokenizer:
        """The actor folder's tokenizer; the character tokenizer for the built-in warmed-up policy, after
        checking that every model the warm-up would build has its vocabulary (before anything starts)."""
        actor = self.plan.roles["actor"]
        for role, rp in self.plan.roles.items():
            if role_weights(self.plan, role, self.reward_example) is None:
                check_warmup_shape(rp.model)  # the built-in policy: warmed up here, character vocabulary only
        if actor.path:
            return load_tokenizer(actor.path, model_vocab=ModelSpec.from_hf_config(actor.path).vocab)
        return CharTokenizer()

    def model_path(self, role: str) -> str:
        path = role_weights(self.plan, role, self.reward_example)
        if path:
            return path
        rp = self.plan.roles[role]
        cfg = self.config.warmup_config()
        if cached_policy(rp.model, cfg) is None:
            self.events.phase("warmup", f"warming up the built-in policy '{rp.model.name}' on task '{cfg.task}', the "
                              f"first time only ({warmup_cost(rp.model, cfg).describe()}; it stops early once "
                              f"{cfg.target_greedy_accuracy:.0%} of held-out prompts come out exact)", total=cfg.max_steps)
        return str(warm_policy(rp.model, cfg, on_step=lambda step, _: self.events.advance(step)))

    def rollout_settings(self, on_trainer: bool) -> RolloutSettings:
        s, w, actor = self.config.sampling, self.plan.workload, self.plan.roles["actor"]
        agent = self.config.agent  # conversations: a `generate` call is one model turn (agents/trainer_rollout.py)
        partial = self.config.async_mode.partial_rollout_tokens  # async partial rollouts: a round's tokens per call
        per_call = agent.turn_tokens if agent.enabled else partial if partial and not on_trainer else w.response_len
        sampling = SamplingParams(max_new_tokens=per_call,
                                  temperature=s.temperature, top_p=s.top_p,
                                  top_k=s.top_k, eos_token_id=self.tok.eos_ids, pad_token_id=self.tok.pad_id)
        return RolloutSettings(backend=actor.rollout, generation=self.plan.generation_config() if on_trainer else None,
                               reshard=self.plan.reshard, sampling=sampling, prompt_len=w.prompt_len,
                               memory_fraction=actor.rollout_memory_fraction,
                               max_concurrent_sequences=actor.max_concurrent_sequences)

    def role_spec(self, role: str) -> RoleSpec:
        cfg, w, rp = self.config, self.plan.workload, self.plan.roles[role]
        common = dict(micro_batch_size=w.micro_batch_size, seed=cfg.seed, micro_batch_tokens=rp.micro_batch_tokens)

        def update(optim) -> UpdateSettings:
            return UpdateSettings(optim=optim, epochs=w.ppo_epochs, mini_batches=w.mini_batches)

        if role in ("actor", "ref"):
            kw = dict(temperature=cfg.sampling.temperature, **common)  # log-probs at the sampling temperature
            if role == "actor":
                kw.update(update=update(cfg.optimizer.actor),
                          objective=PolicyObjective(loss=cfg.loss, kl=cfg.kl, norm_length=w.response_len),
                          # generation on rollout devices of its own: rl/rollout.py
                          rollout=None if rp.generate_group else self.rollout_settings(on_trainer=True))
            if rp.lora is not None:  # adapters on the frozen actor; its base is the reference
                kw["lora"] = rp.lora
            return RoleSpec(PolicyWorker, rp.train, (self.model_path(role),), kw)
        if role in TRAINED_ROLES:  # a critic
            common.update(update=update(cfg.optimizer.critic), value_loss=cfg.value_loss)
            if rp.lora is not None:
                common["lora"] = rp.lora
        return RoleSpec(ValueWorker, rp.train, (self.model_path(role),), common)

    def launch(self, groups: dict[str, WorkerGroup], checkpoint_dir: Location | None,
               export_dir: Location | None) -> None:
        """Start every group of the plan at once; `groups` (role → its group) fills as each is made,
        so whoever owns it can shut down those made when a later one fails."""
        specs = {role: self.role_spec(role) for role in self.plan.roles}  # warm-up happens here, once
        cluster = self.config.cluster
        pools = ResourcePool.from_plan(self.plan, timeout_s=cluster.start_timeout_s)
        with output_markers({"--checkpoint-dir": checkpoint_dir, "--export-hf": export_dir}) as shared:
            launched = []  # their processes start at once, then start_together waits for all
            for g in self.plan.groups:
                roles = self.plan.roles_in(g.name)
                if roles:
                    self.events.phase("workers", f"starting {len(g.devices)} worker process(es) for group "
                                      f"'{g.name}' ({', '.join(roles)})")
                    self.events.say(place_pool(pools[g.name]))
                    folders = [model_folder(specs[r].args[0], f"the {r}'s weights folder") for r in roles]
                    group = WorkerGroup(
                        pools[g.name], {r: specs[r] for r in roles}, name=g.name,
                        init_timeout_s=cluster.start_timeout_s, call_timeout=cluster.call_timeout_s,
                        on_role=lambda r: self.events.phase("weights", f"loading {r}'s weights"),
                        on_wait=lambda stage, s, g=g: self.events.say(f"group '{g.name}': {stage}: {s:.0f} s…"),
                        shared_paths=shared + folders, start=False)
                    launched.append(group)
                    groups.update({r: group for r in roles})
            rollout_devices = self.plan.roles["actor"].generate_group
            if rollout_devices:
                self.events.phase("workers", f"starting {len(self.plan.group(rollout_devices).devices)} "
                                  f"rollout worker process(es) for group '{rollout_devices}'")
                groups[ROLLOUT] = start_rollout_group(self.plan, pools[rollout_devices], specs["actor"].args[0],
                                                      self.rollout_settings(on_trainer=False), self.config.seed,
                                                      start=False)
                launched.append(groups[ROLLOUT])
            start_together(launched)
