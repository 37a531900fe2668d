"""Training-inference mismatch metrics of a PPO step, global over the data-parallel ranks:
the sampler's log-probs of the generated tokens (``rollout_log_probs``) against the training
engine's old log-probs of the same tokens, and for MoE the share of (token, layer) routes the
training forward would have chosen differently from the rollout (counted before any replay).

- ``rollout/logprob_diff_mean``, ``rollout/logprob_diff_max``: mean and max of
  ``|rollout - old|`` over response tokens;
- ``rollout/k3_kl``: K3 estimate of KL(rollout || old) on the rollout's samples,
  ``exp(old - rollout) - (old - rollout) - 1`` averaged over response tokens;
- ``router/route_mismatch``: differing / compared routes (MoE with routes only).

Correcting for the mismatch (importance weights, rejection) and its ``rollout_corr/...``
metrics: :mod:`parallel_models.rl.algorithms.rollout_correction`.
"""

from __future__ import annotations

import torch

from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.observe import dp_stats


def rollout_mismatch_metrics(batch, route_session=None) -> dict[str, float]:
    out: dict[str, float] = {}
    rollout = batch.get("rollout_log_probs")
    if rollout is not None:
        old = batch["old_log_probs"].float()
        rollout = rollout.to(old.device).float()
        mask = batch["response_mask"].to(old.device).bool()
        diff = torch.where(mask, (rollout - old).abs(), torch.zeros_like(old))
        out["rollout/logprob_diff_mean"] = dp_stats.masked_mean(diff, mask)
        out["rollout/logprob_diff_max"] = dp_stats.data_parallel_max(diff)
        # kl_penalty(logprob, ref, "k3") estimates KL(pi || ref) on samples of pi = the rollout
        k3 = algos.kl_penalty(rollout, old, "k3")
        out["rollout/k3_kl"] = dp_stats.masked_mean(torch.where(mask, k3, torch.zeros_like(k3)),
                                                    mask)
    if route_session is not None and batch.get("routes") is not None:
        counts = dp_stats.data_parallel_sum(torch.tensor(
            [float(route_session.differing), float(route_session.compared)], dtype=torch.float64))
        if counts[1] > 0:
            out["router/route_mismatch"] = float(counts[0] / counts[1])
    return out
