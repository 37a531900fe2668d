"""Every PPO role follows the one protocol the trainer calls (rl/roles/model_roles.py): offload / onload /
on_device, plus what the role is for (log_probs, values, score, update)."""

import torch

from parallel_models.rl.rewards.model import RewardModel
from parallel_models.rl.roles.model_roles import (CriticRole, LogProbRole, PolicyRole, Role, RuleReward,
                                      ScoreRole, TrainableRole, ValueRole)


def test_role_classes_follow_the_protocol():
    assert issubclass(PolicyRole, LogProbRole) and issubclass(PolicyRole, TrainableRole)
    assert issubclass(CriticRole, ValueRole) and issubclass(CriticRole, TrainableRole)
    assert issubclass(RuleReward, ScoreRole) and issubclass(RewardModel, ScoreRole)
    assert not issubclass(RuleReward, TrainableRole) and not issubclass(CriticRole, LogProbRole)
    for cls in (PolicyRole, CriticRole, RuleReward, RewardModel):
        assert issubclass(cls, Role), cls


def test_rule_reward_scores_decoded_text_and_moves_nothing():
    class Tok:
        def batch_decode(self, rows, skip_special_tokens=True):
            return ["".join(chr(96 + t) for t in r) for r in rows]

    reward = RuleReward(lambda prompts, responses: [len(p) + 10 * len(r)
                                                    for p, r in zip(prompts, responses)], Tok())
    seq = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 0]])
    am = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    batch = {"sequences": seq, "attention_mask": am, "response_mask": am[:, 3:]}
    assert reward.score(batch).tolist() == [22.0, 13.0]
    assert reward.offload() == 0 and reward.onload() == 0
    with reward.on_device(with_optimizer=True) as r:
        assert r is reward
