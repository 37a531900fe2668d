"""Route tensors (``utils/routes.py``) and the batch / loss pieces of router replay, single
process: compact dtypes round-trip with missing routes, RolloutBatch pads and selects its
``routes`` column, microbatches pack them like their tokens, and truncated importance sampling
follows verl's convention (``min(exp(old - rollout), cap)`` times the per-token PPO loss)."""

import torch

from parallel_models.rl.algorithms import losses
from parallel_models.rl.data.batch import RolloutBatch
from parallel_models.rl.roles.model_roles import make_microbatches
from parallel_models.utils import routes as route_utils


def test_compact_routes_round_trip_with_missing():
    idx = torch.tensor([[0, 3], [-1, -1], [254, 1]])
    for experts, dtype in ((255, torch.uint8), (1000, torch.int16), (40000, torch.int32)):
        small = route_utils.compact(idx.clamp(max=experts - 1), experts)
        assert small.dtype == dtype
        assert torch.equal(route_utils.expand(small), idx.clamp(max=experts - 1))


def _batch(prompt, resp, rows=2):
    width = prompt + resp
    routes = torch.arange(rows * width * 2 * 2).reshape(rows, width, 2, 2) % 4
    return RolloutBatch(sequences=torch.ones(rows, width, dtype=torch.long),
                        attention_mask=torch.ones(rows, width, dtype=torch.long),
                        prompt_lengths=torch.full((rows,), prompt),
                        response_mask=torch.ones(rows, resp, dtype=torch.long),
                        group_index=torch.arange(rows),
                        routes=route_utils.compact(routes, 4))


def test_batch_concat_pads_routes_with_missing_and_microbatches_pack_them():
    a, b = _batch(3, 2), _batch(1, 4)
    both = RolloutBatch.concat([a, b])
    assert both.routes.shape == (4, 7, 2, 2)
    full = route_utils.expand(both.routes)
    assert torch.equal(full[:2, :5], route_utils.expand(a.routes))
    assert torch.equal(full[:2, 5:], torch.full((2, 2, 2, 2), -1))  # b's longer response
    assert torch.equal(full[2:, :2], torch.full((2, 2, 2, 2), -1))  # a's longer prompt
    assert torch.equal(full[2:, 2:], route_utils.expand(b.routes))
    sel = both.select([3, 0])
    assert torch.equal(sel.routes[1], both.routes[0])
    both.attention_mask[0, :3] = 0  # a left-padded prompt: its routes are not packed
    mbs, indices = make_microbatches(both, max_tokens=7)
    assert len(mbs) > 1
    for mb, rows in zip(mbs, indices):
        mask = both.attention_mask[rows].bool()
        assert mb["routes"].dtype == torch.uint8
        assert torch.equal(mb["routes"], both.routes[rows][mask])
        assert mb["routes"].shape == (int(mb["cu_seqlens"][-1]), 2, 2)


def test_truncated_importance_sampling_follows_verl():
    g = torch.Generator().manual_seed(0)
    old, rollout, logp, adv = (torch.randn(3, 5, generator=g) for _ in range(4))
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    w = losses.truncated_is_weights(old, rollout, cap=2.0)
    assert torch.allclose(w, torch.exp(old - rollout).clamp(max=2.0))
    loss, _ = losses.compute_policy_loss(old, logp, adv, mask, token_weights=w,
                                         loss_agg_mode="token-mean")
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
    expected = (per_token * w * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected, atol=1e-6)
