"""LoRA in PPO on the megatron backend: ``parallel-models-ppo actor.lora.rank=8
critic.lora.rank=8`` (GAE) raises the built-in job's reward, logs the adapters' parameter counts
(the critic's with its value head), exports ``actor_lora/`` and ``critic_lora/`` (PEFT reads
them: the logits / values of the merged ``actor_hf/`` / ``critic_hf/``) and checkpoints only the
adapters (and the critic's head); a run killed after its checkpoint resumes exactly; the hybrid engine's rollout copy gets the merged weights; the run
holds one copy of the base weights (the reference is the actor with its adapters off)."""

import json
import os
import re

import pytest
import torch

from parallel_models.testing import run_distributed, run_named_jobs
from tests.helpers import lora_checks
from tests.helpers.ppo_runs import resume_after_kill_matches, run_metrics, run_ppo

LORA = ["actor.lora.rank=8"]
CRITIC_LORA = ["critic.lora.rank=8"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora_ppo") / "run")
    proc = run_ppo([f"trainer.output_dir={out}", "trainer.total_steps=14", "trainer.save_every=7",
                    *LORA, *CRITIC_LORA], timeout=900)
    return out, proc


def test_lora_job_raises_reward(lora_run):
    out, _ = lora_run
    rewards = [m["reward/mean"] for m in run_metrics(out)]
    assert len(rewards) == 14
    # measured (seeded, CPU; LoRA critic): 0.02-0.05 over the first steps, near 0.1 by steps
    # 12-14 (full fine-tuning, which also trains the embedding and the head, is above 0.3 then)
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.04 and last > 2 * first, f"reward did not rise: {rewards}"
    # the in-process rollout runs the LoRA model: its log-probs are the training forward's
    assert max(m["rollout/logprob_diff_max"] for m in run_metrics(out)) <= 1e-5


def test_trainable_count_is_logged_and_is_the_adapters(lora_run):
    from transformers import AutoConfig

    out, proc = lora_run
    m = re.search(r"actor: LoRA rank 8 .*: (\d+) trainable parameters", proc.stderr)
    critic = re.search(r"critic: LoRA rank 8 .*: (\d+) trainable parameters \(the adapters "
                       r"and the value head\)", proc.stderr)
    assert m and critic, proc.stderr[-2000:]
    cfg = AutoConfig.from_pretrained(os.path.join(out, "builtin_model"))
    h, d = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv, ffn = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    per_layer = sum(8 * (i + o) for i, o in [(h, q), (h, kv), (h, kv), (q, h), (h, ffn),
                                              (h, ffn), (ffn, h)])
    assert int(m.group(1)) == per_layer * cfg.num_hidden_layers
    assert int(critic.group(1)) == per_layer * cfg.num_hidden_layers + h  # + the value head


def test_exported_adapter_is_read_by_peft_and_equals_the_merged_export(lora_run):
    out, _ = lora_run
    with open(os.path.join(out, "actor_lora", "adapter_config.json")) as f:
        assert json.load(f)["r"] == 8
    logits = lora_checks.exported_run_logits(out)
    before, peft_logits, merged = logits["base"], logits["peft"], logits["merged"]
    assert lora_checks.rel(peft_logits, merged) <= 1e-5
    assert lora_checks.rel(before, merged) > 1e-4, "training did not change the adapters"


def test_exported_critic_adapter_is_read_by_peft_and_equals_the_merged_export(lora_run):
    """``critic_lora/`` is PEFT's SEQ_CLS adapter (the value head saved whole, as its
    ``modules_to_save``): loaded on the base model it gives the merged ``critic_hf/``'s
    per-token values."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    out, _ = lora_run
    with open(os.path.join(out, "critic_lora", "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["task_type"] == "SEQ_CLS" and "score" in cfg["modules_to_save"], cfg
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))

    def values(model):  # per-token values: the head on every hidden state
        hidden = model.model(input_ids=ids).last_hidden_state
        return model.score(hidden)

    with torch.no_grad():
        base = AutoModelForSequenceClassification.from_pretrained(
            os.path.join(out, "builtin_model"), num_labels=1, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, os.path.join(out, "critic_lora"))
        got = values(peft_model.base_model.model)
        with peft_model.disable_adapter():
            base_values = values(peft_model.base_model.model)
        merged = values(AutoModelForSequenceClassification.from_pretrained(
            os.path.join(out, "critic_hf"), dtype=torch.float32))
    assert lora_checks.rel(got, merged) <= 1e-5
    assert lora_checks.rel(base_values, merged) > 1e-4, "training did not change the adapters"


def test_checkpoint_holds_only_the_adapters(lora_run):
    from torch.distributed.checkpoint import FileSystemReader

    out, _ = lora_run
    steps = sorted(d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_"))
    assert steps, "no checkpoint was written"
    folder = os.path.join(out, "checkpoints", steps[-1], "dist")
    keys = list(FileSystemReader(folder).read_metadata().state_dict_metadata)
    actor = [k for k in keys if k.startswith("actor.") or ".actor." in k]  # weights, Adam states
    assert len(actor) == 3 * sum(k.startswith("actor.") for k in keys) > 0
    assert all(".lora." in k for k in actor), [k for k in actor if ".lora." not in k][:5]
    critic = [k for k in keys if k.startswith("critic.") or ".critic." in k]
    assert len(critic) == 3 * sum(k.startswith("critic.") for k in keys) > 0
    # the critic's adapters and its value head (megatron's output_layer), nothing else
    assert [k for k in critic if ".lora." not in k and not k.endswith("critic.output_layer.weight")
            ] == []
    assert "critic.output_layer.weight" in keys


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_lora_run_resumes_after_kill(tmp_path):
    resume_after_kill_matches(tmp_path, [*LORA, *CRITIC_LORA, "trainer.total_steps=3",
                                         "trainer.save_every=2", "trainer.save_hf_at_end=false",
                                         "trainer.loggers=[jsonl]"], steps=3)


def test_merged_rollout_logits_equal_the_lora_model(hf_models):
    path = hf_models[("llama", "causal_lm")]
    for res in run_distributed(lora_checks.check_merged_rollout, 2, path, 2, 1):
        assert res["rel"] <= 1e-5, res
        assert res["restored"] and not res["rollout_has_lora"], res
        assert res["lora_effect"] > 1e-3, res


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_one_copy_of_the_base_weights(tmp_path):
    common = ["algorithm.adv_estimator=grpo", "critic.enable=false", "actor.use_kl_loss=true",
              "algorithm.kl_in_reward=false", "trainer.loggers=[jsonl]"]
    res = run_named_jobs([
        ("lora", 1, (lora_checks.count_parameters_in_memory,
                     ([f"trainer.output_dir={tmp_path / 'lora'}", "actor.lora.rank=8", *common],))),
        ("full", 1, (lora_checks.count_parameters_in_memory,
                     ([f"trainer.output_dir={tmp_path / 'full'}", *common],)))])
    lora, full = res["lora"][0], res["full"][0]
    assert lora["reference"] == "AdapterFreeReference"
    assert lora["in_memory"] == lora["actor_frozen"] + lora["actor_trainable"], lora
    assert lora["actor_frozen"] == full["actor_total"]
    assert full["in_memory"] == 2 * full["actor_total"], full  # actor + reference copy


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_lora_ppo_steps_tp2_sp_and_pp2_equal_tp1(tmp_path):
    """Two LoRA PPO steps (rollout, reference with adapters off, critic, actor update): the
    exported adapters at TP=2 + SP and at PP=2 (rollouts from the hybrid engine's merged copy)
    equal TP=1's, and the second step's rollouts sampled from the trained LoRA policy."""
    from tests.helpers.ppo_runs import load_folder

    outs = {name: str(tmp_path / name) for name in ("tp1", "tp2", "pp2")}
    run_distributed(lora_checks.lora_ppo_steps, 1, outs["tp1"], 1, False)
    run_distributed(lora_checks.lora_ppo_steps, 2, outs["tp2"], 2, True)
    run_distributed(lora_checks.lora_ppo_steps, 2, outs["pp2"], 1, False, 2)
    a1 = load_folder(os.path.join(outs["tp1"], "actor_lora"))
    moved = sum(bool(v.abs().max() > 0) for k, v in a1.items() if "lora_B" in k)
    assert a1 and moved == sum("lora_B" in k for k in a1), "the update left some B at zero"
    for name in ("tp2", "pp2"):
        # step 2's rollout (PP=2: the hybrid engine's merged copy) sampled from the trained
        # LoRA policy (nonzero B), the one the training forward scores
        assert run_metrics(outs[name])[1]["rollout/logprob_diff_max"] <= 1e-5, name
        a2 = load_folder(os.path.join(outs[name], "actor_lora"))
        assert a1.keys() == a2.keys()
        for k in a1:
            assert lora_checks.rel(a2[k], a1[k]) <= 1e-4, (name, k)


def test_lora_settings_that_cannot_work_name_the_key():
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config.ppo import load_config

    with pytest.raises(ConfigError, match="rollout.weight_push=folder: a LoRA actor"):
        load_config(None, ["actor.lora.rank=8", "rollout.backend=server",
                           "rollout.server_url=http://127.0.0.1:1", "rollout.weight_push=folder"])
    with pytest.raises(ConfigError, match="actor.lora.rnk"):
        load_config(None, ["actor.lora.rnk=8"])


@pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py
def test_lora_checkpoint_saved_at_tp2_sp_resumes_at_tp1(tmp_path):
    """Adapters (actor's; critic's with its value head) and their Adam states saved at TP=2 +
    SP load at TP=1: they are bit-exact and the next step's losses match the TP=2 run's within 1e-5."""
    out2, out1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    saved = run_distributed(lora_checks.lora_save_then_step, 2, out2, 2, True)[0]
    resumed = run_distributed(lora_checks.lora_resume_then_step, 1, out1, saved["path"], 1,
                              os.path.join(out2, "builtin_model"))[0]
    assert resumed["step"] == 2
    for role in ("adapters", "critic"):
        assert saved[role].keys() == resumed[role].keys()
        for k, v in saved[role].items():
            assert torch.equal(v, resumed[role][k]), (role, k)
    assert "base_model.model.score.weight" in saved["critic"]
    want, got = saved["metrics"], resumed["metrics"]
    for key in ("actor/pg_loss", "critic/vf_loss", "reward/mean", "kl/actor_ref"):
        assert abs(want[key] - got[key]) <= 1e-5, f"{key}: TP=2 {want[key]} vs TP=1 {got[key]}"
