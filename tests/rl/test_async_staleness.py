"""The staleness rule of an async run (``rl/async_rollout/``), on a queued step whose samples
were drawn by weights of several ages: a sample more than ``rollout.max_staleness`` versions
behind is never trained on (``drop``: its response mask zeroed; ``regenerate``: the step's
prompts generated again under the current weights), weights the run did not push count as
too old, and the metrics count what happened."""

import pytest
import torch

from parallel_models.rl.async_rollout.producer import PlannedStep, Produced
from parallel_models.rl.async_rollout.rollout import AsyncServerRollout
from parallel_models.rl.async_rollout.versions import PolicyVersions, sample_staleness


class _QueuedStep:
    """The producer's side: one queued step, no waiting."""

    def __init__(self, item):
        self.item = item

    def take(self, step, check=None):
        assert step == self.item.step
        return self.item

    def take_idle(self):
        return 0.25

    def ready(self):
        return 0


def _rollout(policy: str, token_versions, fresh_versions):
    r = AsyncServerRollout.__new__(AsyncServerRollout)
    r.max_staleness, r.stale_policy = 1, policy
    r.pusher = None  # (the push is not the subject here)
    r.versions = PolicyVersions()
    for trainer_version, server_version in ((0, 10), (1, 11), (2, 12), (3, 13)):
        r.versions.pushed(trainer_version, server_version)
    r.version = 3
    batch = {"response_mask": torch.ones(len(token_versions), 2, dtype=torch.long)}
    r.producer = _QueuedStep(Produced(7, batch, token_versions))
    r.requests = []

    def request(planned):
        r.requests.append(planned.step)
        fresh = {"response_mask": torch.ones(len(fresh_versions), 2, dtype=torch.long)}
        return fresh, fresh_versions

    r._request = request
    return r


# samples drawn by trainer versions 1 (2 behind), 2, 3, 2 -> 3 (a partial one) and a stranger's
QUEUED = [[11, 11], [12, 12], [13, 13], [12, 13], [99, 99]]


def test_staleness_counts_the_oldest_token():
    assert sample_staleness(3, [[1, 1], [2, 3], [3], [None, 3]]) == [2, 1, 0, None]


def test_drop_keeps_stale_samples_out_of_the_update():
    r = _rollout("drop", QUEUED, None)
    batch, m = r._step_samples(PlannedStep(7, [[1]], None))
    assert batch["response_mask"].sum(-1).tolist() == [0, 2, 2, 2, 0]
    assert r.requests == []
    assert m["async/dropped_samples"] == 2 and m["async/regenerated_samples"] == 0
    assert m["async/staleness_max"] == 1 and m["async/staleness_mean"] == pytest.approx(2 / 3)
    assert m["async/partial_samples"] == 1 and m["async/rollout_idle_s"] == 0.25
    assert batch["token_versions"] == [[1, 1], [2, 2], [3, 3], [2, 3], [-1, -1]]


def test_regenerate_draws_the_step_again_under_the_current_weights():
    r = _rollout("regenerate", QUEUED, [[13, 13]] * 5)
    batch, m = r._step_samples(PlannedStep(7, [[1]], None))
    assert r.requests == [7]
    assert batch["response_mask"].sum(-1).tolist() == [2] * 5
    assert m["async/regenerated_samples"] == 2 and m["async/dropped_samples"] == 0
    assert m["async/staleness_max"] == 0 and m["async/partial_samples"] == 0
    assert batch["token_versions"] == [[3, 3]] * 5
