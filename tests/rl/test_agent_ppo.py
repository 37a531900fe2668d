"""Multi-turn rollouts in the PPO trainer on the built-in model: the log-probs the rollout
recorded for the model's tokens equal the training side's recompute of the whole conversation
(the actor's forward over prompt, turns and appended environment messages; <= 1e-6 in fp32)
although the response mask has holes, at TP=1 and TP=2; the rollout metrics count the turns;
the reward sees the conversation and the environment's rewards are added."""

import pytest

from parallel_models.testing import run_distributed

ENV = '''
class Env:
    """Three turns: after each turn the user says "go on"; the third ends it, reward 0.25."""

    def reset(self, record):
        self.turns = 0
        return []

    def step(self, turn_text, turn_ids):
        self.turns += 1
        if self.turns == 3:
            return [], 0.25, True
        return [{"role": "user", "content": "go on"}], 0.0, False
'''


def rollout_then_recompute(output_dir: str, tp: int, env_file: str) -> dict:
    import torch

    from parallel_models.rl.config import load_config
    from parallel_models.rl.trainer import PPOTrainer

    cfg = load_config(None, [f"trainer.output_dir={output_dir}", "trainer.total_steps=1",
                             f"parallel.tensor_parallel_size={tp}", "trainer.save_every=0",
                             "trainer.loggers=[jsonl]", "data.batch_size=4", "rollout.n=2",
                             "actor.mini_batch_size=8", "rollout.max_new_tokens=6",
                             "rollout.multi_turn.max_turns=4",
                             f"rollout.multi_turn.environment={env_file}:Env",
                             "rollout.multi_turn.tools=[calculator]"])
    cfg.validate()
    trainer = PPOTrainer(cfg)
    batch = trainer.rollout_phase()
    plain = trainer.reward.score(batch)
    trainer.score_phase(batch)  # the actor's log-probs of the whole sequences (old_log_probs)
    mask = batch.response_mask.bool()
    P = batch.sequences.shape[1] - mask.shape[1]
    real = batch.attention_mask[:, P:].bool()
    holes = [bool((~m[:int(r.sum())]).any()) for m, r in zip(mask, real)]
    diff = (batch.rollout_log_probs.float() - batch.old_log_probs.float())[mask].abs()
    return {"max_diff": float(diff.max()), "tokens": int(mask.sum()), "holes": holes,
            "appended_attended": bool((real & ~mask).any()),
            "zero_outside": bool((batch.rollout_log_probs[~mask] == 0).all()),
            "metrics": dict(trainer.rollout.metrics),
            "record_keys": sorted(batch["records"][0]) if batch.get("records") else [],
            "conversation_roles": [m["role"] for m in batch["records"][0]["conversation"]],
            "env_bonus": (batch.scores - plain).tolist()}


@pytest.mark.parametrize("tp", [1, 2])
def test_multi_turn_log_probs_equal_the_training_recompute(tmp_path, tp):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV)
    got = run_distributed(rollout_then_recompute, tp, str(tmp_path / "run"), tp,
                          str(env_file))[0]
    assert all(got["holes"])  # every row: model tokens, appended tokens, model tokens
    assert got["appended_attended"] and got["zero_outside"]
    assert got["max_diff"] <= 1e-6, got["max_diff"]
    assert got["tokens"] > 8 * 3
    assert got["metrics"]["rollout/turns_mean"] == 3.0
    assert got["metrics"]["rollout/cut_max_turns"] == 0.0
    assert {"conversation", "tool_trace"} <= set(got["record_keys"])
    assert got["conversation_roles"] == ["user", "assistant", "user", "assistant", "user",
                                         "assistant"]
    assert got["env_bonus"] == pytest.approx([0.25] * 8)
