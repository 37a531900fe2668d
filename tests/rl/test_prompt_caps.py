"""Per-prompt response caps (``data.max_new_tokens_key``): a prompt capped at c tokens gets
exactly the first c tokens its uncapped greedy run gives, in the static and the continuous
engine; the trainer reads the caps from the dataset records, through the in-process engine and
the hybrid engine at PP=2; a bad value is an error naming the file, the prompt and the key."""

from __future__ import annotations

import json

import pytest
import torch

from parallel_models.testing import run_distributed_jobs

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

CAPS = [1, 3, 5, 6]  # the four prompts' caps; rollout.max_new_tokens = 6
RUN = ["trainer.total_steps=2", "data.batch_size=4", "rollout.n=2", "actor.mini_batch_size=8",
       "rollout.max_new_tokens=6", "actor.ppo_epochs=1", "rollout.ignore_eos=true",
       "algorithm.adv_estimator=grpo", "critic.enable=false", "data.max_new_tokens_key=budget"]


@pytest.mark.parametrize("continuous", [False, True])
def test_capped_prompt_is_the_prefix_of_its_uncapped_run(tmp_path, continuous):
    import parallel_models as pm
    from parallel_models.inference.engine import RolloutEngine
    from parallel_models.inference.sampling import SamplingParams
    from parallel_models.testing import save_tiny_hf_model

    pm.init_parallel()
    path = save_tiny_hf_model(str(tmp_path / "m"), "llama", seed=0)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    engine = RolloutEngine(model, kv_budget_tokens=256 if continuous else None, max_rows=8)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    params = SamplingParams(greedy=True, ignore_eos=True, max_new_tokens=6, n=2)
    full = engine.generate_samples(prompts, params)
    capped = engine.generate_samples(prompts, params, max_new_tokens=CAPS)
    for i, cap in enumerate(CAPS):
        for s in range(2):
            row = 2 * i + s
            assert capped[row]["token_ids"] == full[row]["token_ids"][:cap]
            assert capped[row]["log_probs"] == pytest.approx(full[row]["log_probs"][:cap],
                                                             abs=1e-6)
            assert capped[row]["finish_reason"] == "length"
    with pytest.raises(ValueError, match=r"caps must be in 1\.\.6"):
        engine.generate(prompts, params, max_new_tokens=[1, 3, 7, 2])
    pm.destroy_parallel()


def test_bad_cap_names_the_file_prompt_and_key():
    from types import SimpleNamespace

    from parallel_models.rl.data.prompts import DataError, prompt_caps

    cfg = SimpleNamespace(max_new_tokens_key="budget", path="train.jsonl", task=None)
    batch = {"records": [{"budget": 4}, {"budget": "5"}, {}], "indices": [7, 3, 9]}
    assert prompt_caps(batch, [0], cfg, 6) == [4]
    for row, shown in ((1, "'5'"), (2, "None")):
        with pytest.raises(DataError, match=rf"train\.jsonl: prompt {batch['indices'][row]}: "
                                            rf"data\.max_new_tokens_key 'budget' = {shown}"):
            prompt_caps(batch, [row], cfg, 6)
    with pytest.raises(DataError, match="1..6"):
        prompt_caps({"records": [{"budget": 9}], "indices": [0]}, [0], cfg, 6)


def test_trainer_reads_the_caps_in_process_and_through_the_hybrid_engine(tmp_path):
    from tests.helpers import hybrid_checks

    data = tmp_path / "caps.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "budget": c}) + "\n"
                            for p, c in zip(["aei", "bou", "xyz", "kaa"], CAPS)))
    layouts = {"static, 1 rank": (1, []),
               "continuous, 1 rank": (1, ["rollout.kv_budget_tokens=128"]),
               "PP=2 hybrid, continuous": (2, ["parallel.pipeline_parallel_size=2",
                                               "rollout.kv_budget_tokens=128"])}
    for name, (world, layout) in layouts.items():
        jobs = [(hybrid_checks.ppo_metrics, (str(tmp_path / name.replace(" ", "")),
                                             RUN + [f"data.path={data}"] + layout), {})]
        rows = run_distributed_jobs(jobs, world, timeout=400)[0][0]
        # ignore_eos: every sample runs to its prompt's cap, so the mean length is the caps'
        assert [m["response_length/mean"] for m in rows] == [sum(CAPS) / 4] * 2, name
