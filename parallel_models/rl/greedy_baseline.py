"""The greedy baseline rollout of estimators that declare ``needs_greedy_baseline`` (ReMax): one
greedy response per prompt, scored by the run's reward.

Each sampled response of the prompt gets that score as its baseline (``batch["reward_baselines"]``,
read by the advantage phase, logged as ``reward/greedy_baseline_mean``); ReMax is Li et al. 2023,
arXiv:2310.10505."""

from __future__ import annotations

from parallel_models.rl.algorithms import estimators


def wants_greedy_baseline(cfg) -> bool:
    """Whether the run's advantage estimator declares ``needs_greedy_baseline``."""
    return estimators.declares(cfg.algorithm, "needs_greedy_baseline")


def greedy_baselines(trainer, prompt_ids: list[list[int]], records: list[dict] | None,
                     max_new_tokens: list[int] | None = None) -> list[float]:
    """The greedy response's score of each prompt of ``prompt_ids`` (this rank's prompts, in
    the order the rollout repeats them), repeated ``rollout.n`` times: one per row of the
    step's batch. ``records``: the prompts' dataset records (the reward reads their fields)."""
    params = trainer.sampling.model_copy(update={"n": 1, "greedy": True})
    with trainer._use(trainer.actor):
        greedy = trainer._rollout(prompt_ids, params, max_new_tokens=max_new_tokens)
    if records is not None:
        greedy["records"] = list(records)
        key = trainer.cfg.data.messages_key
        greedy["messages"] = [r.get(key) for r in records]
    scores = trainer.reward.score(greedy)
    n = trainer.cfg.rollout.n
    return [float(s) for s in scores.tolist() for _ in range(n)]


def attach_greedy_baselines(trainer, batch, records, prompt_ids: list[list[int]], mine: list[int],
                            max_new_tokens: list[int] | None = None) -> None:
    """When the run's estimator wants one: ``batch["reward_baselines"]`` from
    :func:`greedy_baselines` of this rank's prompts (``mine``: their places in ``prompt_ids``
    and in the loader's ``records``)."""
    if not wants_greedy_baseline(trainer.cfg):
        return
    has = isinstance(records, dict) and "records" in records
    batch["reward_baselines"] = greedy_baselines(
        trainer, [prompt_ids[i] for i in mine], [records["records"][i] for i in mine] if has
        else None, max_new_tokens=max_new_tokens)
