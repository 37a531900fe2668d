"""The documented example examples/agentic_arithmetic.*: its environment and reward on scripted
conversations (the calculator gives the exact answer; the reward checks it against the dataset),
and a step of the example's run on the built-in model, from the command line."""

import json
import os

import pytest

from parallel_models.inference import SamplingParams
from parallel_models.rl.agents.build import multi_turn_rollout
from parallel_models.rl.agents.reward_inputs import attach_conversations
from parallel_models.rl.config import load_config
from parallel_models.rl.registry import load_function
from tests.helpers.ppo_runs import run_metrics, run_ppo
from tests.rl.test_agent_rollout import TOK, Inner, ScriptedEngine, call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "examples", "agentic_arithmetic.yaml")
ENV = os.path.join(ROOT, "examples", "agentic_arithmetic_env.py")


def test_example_conversations_and_rewards():
    cfg = load_config(CONFIG, [f"rollout.multi_turn.environment={ENV}:Env"])
    records = [{"prompt": "what is 37 * 48?", "answer": 1776},
               {"prompt": "what is 12 - 50?", "answer": -38},
               {"prompt": "what is 3 + 4?", "answer": 7}]
    env = load_function(f"{ENV}:Env", "environment")()
    script = {}
    turns = [[call("calculator", expression="37 * 48"), "it is 1776"],  # tool, right: 1.1
             [call("calculator", expression="12 - 50"), "-39"],         # tool, wrong: 0.1
             ["7"]]                                                     # no tool, right: 1
    for record, t in zip(records, turns):
        text = TOK.apply_chat_template(env.reset(record), tokenize=False,
                                       add_generation_prompt=True)
        script[text] = t
    engine = ScriptedEngine({})
    engine.script = {tuple(TOK(k, add_special_tokens=False)["input_ids"]): v
                     for k, v in script.items()}
    rollout = multi_turn_rollout(Inner(engine), cfg, TOK)
    batch = rollout.generate([[1, 5]] * 3, SamplingParams(n=1, max_new_tokens=96),
                             records=records)
    rollout.executor.close()
    conversation = batch.columns["conversation"][0]
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "tool",
                                                 "assistant"]
    assert conversation[3]["content"] == "1776"  # the calculator's exact answer
    assert rollout.metrics["rollout/turns_mean"] == pytest.approx(5 / 3)
    batch["records"] = records
    attach_conversations(batch)
    reward = load_function(f"{ENV}:reward", "reward function")
    scores = reward([""] * 3, [""] * 3, records=batch["records"])
    assert scores == pytest.approx([1.1, 0.1, 1.0])


def test_example_runs_from_the_command_line(tmp_path):
    out = str(tmp_path / "run")
    # the example's relative paths are from the repository root
    proc = run_ppo(["--config", CONFIG, "trainer.total_steps=1", f"trainer.output_dir={out}",
                    "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
                    "trainer.loggers=[jsonl]"],
                   env=None)
    (metrics,) = run_metrics(out)
    for key in ("rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors",
                "rollout/tool_time_s", "rollout/cut_total_tokens", "rollout/cut_turn_tokens",
                "rollout/cut_max_turns", "rollout/cut_tool_response"):
        assert key in metrics, key
    assert metrics["rollout/turns_mean"] >= 1
    assert metrics["rollout/logprob_diff_max"] <= 1e-6  # holes or not, the recompute agrees
    assert json.loads(proc.stdout.strip().splitlines()[-1])["steps"] == 1
