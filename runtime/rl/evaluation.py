"""Evaluation on held-out prompts: did training help?

The run config's `eval` section names the held-out set (a file, a `datasets` folder, or the test / validation
split of the training DatasetDict: tasks/prompt_files.py) and how often to evaluate. Before the first update,
every `eval.every` iterations and after the last one, the actor (through its rollout engine, exactly as it
generates for training) answers each held-out prompt:

- greedily once: `eval/accuracy`, the share of prompts whose response scores at least `eval.correct` with the
  task's reward (function or model), and `eval/reward_mean`;
- `eval.samples` = k times at the run's sampling settings: `eval/pass@k`, the share of prompts with at least one
  correct response among the k, and `eval/sample_accuracy`, the share of correct samples;
- the greedy responses' lengths: `eval/response_length_mean`, `eval/response_length_max`, `eval/clipped` (the
  share that reached the response budget without ending);
- `eval_samples`: the first `eval.show` greedy responses with their prompts and rewards.

The evaluation's calls are no part of the measured Timeline (it compares with the simulator's iteration), and
its sampling seeds are apart from training's (`EVAL_ROUND`), so a run's training is the same with or without it.
"""

from __future__ import annotations

import torch

from hybridflow.runtime.controller.batch import Batch
from hybridflow.runtime.rl.stops import cut_at_stops
from hybridflow.runtime.tasks.data import PromptDataset
from hybridflow.runtime.tasks.prompt_files import held_out_source
from hybridflow.simulator.errors import HflowError

EVAL_ROUND = 1_000_003  # the `sample_round` of evaluation rollouts: seeds no training round draws


class Evaluator:
    def __init__(self, trainer, dataset: PromptDataset):
        self.trainer, self.dataset = trainer, dataset
        self.config = trainer.config.eval

    @classmethod
    def for_trainer(cls, trainer) -> Evaluator | None:
        """The run's evaluator (None when it has no held-out set)."""
        cfg = trainer.config
        path, split = held_out_source(cfg.eval.prompts_file, cfg.data.prompts_file)
        if path is None:
            return None
        plan = trainer.plan
        if plan.mode != "sync" and not cfg.eval.prompts_file:
            return None  # the training DatasetDict's held-out split, in an overlapping mode: not evaluated
        if plan.mode != "sync":
            raise HflowError(f"evaluation runs between iterations, and mode '{plan.mode}' keeps a rollout in flight "
                             "across them; evaluate in mode sync (--mode sync), or leave out the held-out set")
        full = PromptDataset.from_file(path, split)
        return cls(trainer, full.only(list(range(min(len(full), cfg.eval.max_prompts)))))

    def due(self, iteration: int, last: int | None) -> bool:
        """Whether to evaluate after `iteration` updates (0: before the first; `last`: the run's final one)."""
        every = self.config.every
        return iteration == 0 or iteration == last or bool(every and iteration % every == 0)

    def _prompts(self) -> Batch:
        t = self.trainer
        rows = list(range(len(self.dataset)))
        prompts, cols = self.dataset.take(rows)
        overlong = t.config.data.overlong
        ids, mask = t.tok.encode_prompts(prompts, t.config.data.chat_template, max_len=t.plan.workload.prompt_len,
                                         overlong="truncate-left" if overlong == "drop" else overlong)
        return Batch({"prompt_ids": ids, "prompt_mask": mask, "data_row": torch.tensor(rows)},
                     non_tensors={"prompt": prompts, **cols}, meta={"data_source": self.dataset.source})

    def _rollout(self, prompts: Batch, greedy: bool) -> Batch:
        df = self.trainer.df
        rollout = df.rollout
        spp = self.trainer.plan.workload.samples_per_prompt
        # greedy: the launch takes one row per samples_per_prompt (ReMax's baseline), so repeat by it
        batch = prompts.repeat_interleave(spp if greedy else self.config.samples)
        rollout.sync_weights(self.trainer.iteration, {})
        out = rollout.collect(rollout.launch(batch, self.trainer.iteration, greedy=greedy, sample_round=EVAL_ROUND))
        return df.score(cut_at_stops(out, self.trainer.tok, self.trainer.config.sampling.stop))

    def run(self) -> dict:
        """Evaluate now: the `eval/…` metrics and `eval_samples`."""
        t = self.trainer
        rec = t.df.recorder
        kept = len(rec.events), list(rec.calls), list(rec.resampled_calls)
        try:
            prompts = self._prompts()
            greedy = self._rollout(prompts, greedy=True)
            sampled = self._rollout(prompts, greedy=False)
        finally:  # no trace of the evaluation in the measured Timeline nor in the iteration's calls
            del rec.events[kept[0]:]
            rec.calls[:], rec.resampled_calls[:] = kept[1], kept[2]
        k, n, bar = self.config.samples, len(prompts), self.config.correct
        g_scores = greedy["reward_scores"].float()
        s_correct = (sampled["reward_scores"].float() >= bar).view(n, k)
        lengths = greedy["response_mask"].sum(-1).float()
        budget = t.plan.workload.response_len
        out = {"eval/prompts": n, "eval/accuracy": (g_scores >= bar).float().mean().item(),
               "eval/reward_mean": g_scores.mean().item(), f"eval/pass@{k}": s_correct.any(-1).float().mean().item(),
               "eval/sample_accuracy": s_correct.float().mean().item(),
               "eval/response_length_mean": lengths.mean().item(), "eval/response_length_max": lengths.max().item(),
               "eval/clipped": (lengths >= budget).float().mean().item()}
        show = min(self.config.show, n)
        if show:
            texts = t.tok.decode_responses(greedy["responses"][:show], greedy["response_mask"][:show])
            out["eval_samples"] = [{"prompt": p if isinstance(p, str) else list(p), "response": r,
                                    "reward": g_scores[i].item()}
                                   for i, (p, r) in enumerate(zip(greedy["prompt"][:show], texts, strict=True))]
        return out


def eval_line(metrics: dict) -> str:
    """One console line of an evaluation's metrics."""
    n = metrics["eval/prompts"]
    k = next(key for key in metrics if key.startswith("eval/pass@")).removeprefix("eval/pass@")
    acc = metrics["eval/accuracy"]
    return (f"held-out ({n} prompts): greedy accuracy {acc:.1%} ({round(acc * n)}/{n}), pass@{k} "
            f"{metrics[f'eval/pass@{k}']:.1%}, reward {metrics['eval/reward_mean']:.3f}; responses "
            f"{metrics['eval/response_length_mean']:.1f} tokens on average, {metrics['eval/response_length_max']:.0f} "
            f"at most, {metrics['eval/clipped']:.0%} cut off at the limit")
