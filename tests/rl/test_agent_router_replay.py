"""Router replay (R3) on multi-turn samples: ``model.path=builtin-moe`` (a tiny Qwen3-MoE) with
a 3-turn environment. The rollout records the routes of every token of the conversation (the
prompt, the model's turns and the appended messages: the turn-synchronous driver on the static
batcher), the training forward replays them, and the rollout-vs-training metrics stay close
(fp32 on the CPU) with the route mismatch logged."""

import pytest

from tests.helpers.ppo_runs import run_metrics, run_ppo

ENV = '''
class Env:
    def reset(self, record):
        self.turns = 0
        return []

    def step(self, turn_text, turn_ids):
        self.turns += 1
        if self.turns == 3:
            return [], 0.0, True
        return [{"role": "user", "content": "go on"}], 0.0, False
'''


def test_multi_turn_moe_grpo_replays_the_conversations_routes(tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV)
    out = str(tmp_path / "run")
    run_ppo([f"trainer.output_dir={out}", "model.path=builtin-moe", "actor.router_replay=R3",
             "algorithm.adv_estimator=grpo", "critic.enable=false", "trainer.save_every=0",
             "trainer.total_steps=1", "trainer.loggers=[jsonl]", "trainer.save_hf_at_end=false",
             "rollout.max_new_tokens=6", "rollout.multi_turn.max_turns=3",
             f"rollout.multi_turn.environment={env_file}:Env"])
    (row,) = run_metrics(out)
    assert row["rollout/turns_mean"] == pytest.approx(3.0)
    assert 0.0 <= row["router/route_mismatch"] <= 1.0
    assert row["rollout/logprob_diff_max"] <= 1e-4, row
