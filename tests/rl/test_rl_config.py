"""The PPO config (parallel_models.rl.config) and the sampling params it shares with the rollout
engine, server and client: defaults and the packaged YAML (rendered from the models), YAML +
dotted overrides, save / reload, unknown keys, wrong types, bounds, cross-field checks reported
together, the entrypoint's --help / --resume. Fast, single process, no model.
"""

import os

import pytest
import yaml

from parallel_models.config import ConfigError
from parallel_models.rl import config as rlcfg
from parallel_models.rl.config import PPOConfig, default_config_path, load_config


def write_yaml(path, data):
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_default_config_is_valid_and_matches_packaged_yaml():
    cfg = load_config(None, [])
    assert cfg.to_dict() == PPOConfig().to_dict()
    assert os.path.isfile(default_config_path())
    from_file = load_config(default_config_path(), [])
    assert from_file.to_dict() == cfg.to_dict()
    # every field of every section is spelled out in the packaged file
    with open(default_config_path()) as f:
        raw = yaml.safe_load(f)
    assert {s: sorted(v) for s, v in raw.items()} == \
        {s: sorted(v) for s, v in cfg.to_dict().items()}


def test_yaml_and_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {
        "actor": {"lr": "1e-5", "ppo_epochs": 3},   # "1e-5" is a string for YAML 1.1
        "rollout": {"n": 2, "stop_token_ids": [5]},
        "trainer": {"total_steps": 7},
        "critic": None,                             # an empty section is allowed
    })
    cfg = load_config(path, ["actor.lr=1e-5", "trainer.total_steps=20", "rollout.backend=inprocess",
                             "rollout.stop_token_ids=[2, 13]", "model.path=null",
                             "algorithm.adv_estimator=grpo", "trainer.output_dir=runs/1",
                             "rollout.temperature=1"])
    assert cfg.actor.lr == pytest.approx(1e-5) and isinstance(cfg.actor.lr, float)
    assert cfg.actor.ppo_epochs == 3                      # from the file
    assert cfg.trainer.total_steps == 20                  # override wins over the file
    assert cfg.rollout.n == 2
    assert cfg.rollout.stop_token_ids == [2, 13]
    assert cfg.model.path is None
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.output_dir == "runs/1"
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["actor.lr=3e-4", "rollout.stop_token_ids=[7]", "data.seed=5"])
    saved = cfg.save(tmp_path / "ckpt" / "config.yaml")
    again = load_config(saved, [])
    assert again.to_dict() == cfg.to_dict()
    assert again.actor.lr == 3e-4


def test_unknown_keys_name_key_and_valid_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["actor.lrr=1e-5"])
    msg = str(e.value)
    assert "'actor.lrr'" in msg and "did you mean 'lr'" in msg
    assert "clip_ratio_low" in msg and "ppo_epochs" in msg       # valid keys of the section
    assert "total_steps" not in msg                                # not other sections' keys

    path = write_yaml(tmp_path / "bad.yaml", {"trainer": {"total_step": 3}})
    with pytest.raises(ConfigError) as e:
        load_config(path, [])
    assert str(tmp_path / "bad.yaml") in str(e.value) and "'trainer.total_step'" in str(e.value)
    assert "save_every" in str(e.value)

    with pytest.raises(ConfigError) as e:
        load_config(None, ["optimizer.lr=1"])
    assert "'optimizer'" in str(e.value) and "actor" in str(e.value) and "rollout" in str(e.value)

    path = write_yaml(tmp_path / "bad2.yaml", {"tarinner": {"seed": 1}})
    with pytest.raises(ConfigError, match="did you mean 'trainer'"):
        load_config(path, [])

    for bad in ("actor=1", "actor.lr.x=1", "trainer.total_steps"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])


@pytest.mark.parametrize("override, words", [
    ("trainer.total_steps=abc", ["trainer.total_steps", "integer", "'abc'"]),
    ("trainer.total_steps=2.5", ["trainer.total_steps", "integer"]),
    ("rollout.greedy=5", ["rollout.greedy", "true/false"]),
    ("actor.lr=fast", ["actor.lr", "number"]),
    ("rollout.backend=grpc", ["rollout.backend", "'grpc'", "inprocess", "server"]),
    ("algorithm.kl_penalty=k4", ["algorithm.kl_penalty", "low_var_kl"]),
    ("rollout.stop_token_ids=3", ["rollout.stop_token_ids", "list"]),
    ("rollout.stop_token_ids=[1, x]", ["rollout.stop_token_ids[1]"]),
    ("data.shuffle=null", ["data.shuffle"]),
    ("model.path=[1]", ["model.path", "string"]),
])
def test_wrong_types_name_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_types_rechecked_by_validate():
    cfg = load_config(None, [])
    cfg.actor.ppo_epochs = "two"
    with pytest.raises(ConfigError, match="actor.ppo_epochs"):
        cfg.validate()


@pytest.mark.parametrize("overrides, words", [
    (["data.batch_size=3", "rollout.n=3", "actor.mini_batch_size=4"],
     ["data.batch_size * rollout.n", "9", "actor.mini_batch_size (4)"]),
    (["algorithm.adv_estimator=grpo", "rollout.n=1", "actor.mini_batch_size=8"],
     ["grpo", "rollout.n >= 2"]),
    (["algorithm.adv_estimator=rloo", "rollout.n=1", "actor.mini_batch_size=8"],
     ["rloo", "rollout.n >= 2"]),
    (["rollout.top_p=1.5"], ["rollout.top_p", "(0, 1]"]),
    (["rollout.temperature=0"], ["rollout.temperature", "greedy"]),
    (["actor.clip_ratio_low=1.5"], ["actor.clip_ratio_low"]),
    (["actor.clip_ratio_c=0.5"], ["actor.clip_ratio_c"]),
    (["algorithm.gamma=1.1"], ["algorithm.gamma", "[0, 1]"]),
    (["data.path=/nonexistent/prompts.jsonl"], ["data.path", "/nonexistent/prompts.jsonl",
                                                "not found"]),
    (["critic.enable=false"], ["adv_estimator=gae", "critic.enable"]),
    (["actor.micro_batch_tokens=32"], ["actor.micro_batch_tokens (32)", "80"]),
    (["reward.function=no_such_module.fn"], ["reward.function", "no_such_module", "not found"]),
    (["reward.type=model"], ["reward.model_path"]),
    (["rollout.backend=server"], ["rollout.server_url"]),
    (["rollout.backend=server", "rollout.server_url=http://h:1",
      "rollout.stop_token_ids=[" + ",".join(map(str, range(10, 74))) + "]"],
     ["rollout.stop_token_ids: 64 ids", "at most 63"]),
    (["rollout.tensor_parallel_size=2"], ["rollout.tensor_parallel_size (2)", "world size (1)"]),
    (["algorithm.kl_ctrl=adaptive", "algorithm.kl_in_reward=false"], ["kl_in_reward"]),
])
def test_validation_messages(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_validation_reports_all_problems_and_world_size(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.top_p=2", "algorithm.lam=-1", "trainer.save_every=-1"])
    msg = str(e.value)
    assert "rollout.top_p" in msg and "algorithm.lam" in msg and "trainer.save_every" in msg

    cfg = load_config(None, [])
    cfg.validate(world_size=2)  # DP=2 divides batch 8 and mini-batch 16
    with pytest.raises(ConfigError, match="data-parallel size"):
        cfg.validate(world_size=3)
    cfg.parallel.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="world size 3 is not divisible"):
        cfg.validate(world_size=3)


def test_validation_tp_must_divide_heads(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "model"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=80).save_pretrained(folder)
    load_config(None, [f"model.path={folder}", "parallel.tensor_parallel_size=2"],
                validate=False).validate(world_size=2)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"):
        load_config(None, [f"model.path={folder}", "parallel.tensor_parallel_size=3"],
                    validate=False).validate(world_size=3)
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, [f"model.path={tmp_path / 'missing'}"])


def test_missing_and_bad_config_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml", [])
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, [])
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(bad, [])
    bad.write_text("actor: 3\n")
    with pytest.raises(ConfigError, match="section 'actor' must be a mapping"):
        load_config(bad, [])




def test_config_sections_are_documented_in_module():
    # every section the trainer reads exists with the names the issue asks for
    want = {
        "model": {"path", "dtype", "tokenizer"},
        "parallel": {"tensor_parallel_size", "pipeline_parallel_size", "sequence_parallel"},
        "data": {"path", "prompt_key", "messages_key", "max_prompt_length", "batch_size",
                 "shuffle", "seed", "task", "val_path", "val_batch_size"},
        "rollout": {"backend", "server_url", "n", "max_new_tokens", "temperature", "top_k",
                    "top_p", "greedy", "stop_token_ids"},
        "actor": {"lr", "weight_decay", "clip_grad", "warmup_steps", "ppo_epochs",
                  "mini_batch_size", "micro_batch_tokens", "clip_ratio_low", "clip_ratio_high",
                  "clip_ratio_c", "entropy_coef", "loss_agg_mode", "use_kl_loss", "kl_loss_coef",
                  "kl_loss_type", "policy_loss"},
        "critic": {"enable", "path", "lr", "weight_decay", "clip_grad", "cliprange_value",
                   "warmup_steps"},
        "reward": {"type", "function", "model_path", "tokenizer", "tensor_parallel_size",
                   "pipeline_parallel_size", "offload"},
        "algorithm": {"adv_estimator", "gamma", "lam", "kl_penalty", "kl_in_reward", "kl_coef",
                      "kl_ctrl", "kl_target", "kl_horizon", "whiten_advantages"},
        "trainer": {"total_steps", "seed", "output_dir", "log_every", "save_every", "resume",
                    "offload", "loggers", "save_hf_at_end", "max_checkpoints", "test_freq",
                    "val_before_train", "val_greedy", "val_samples_logged", "project_name",
                    "experiment_name"},
        "kernels": {"compile", "cuda_graphs", "decode_attention", "fused_draw", "wgrad_fusion"},
    }
    have = PPOConfig().to_dict()
    assert set(have) == set(want) == set(rlcfg.SECTIONS)
    for section, keys in want.items():
        assert keys <= set(have[section]), (section, keys - set(have[section]))


def test_packaged_yaml_is_the_rendering_of_the_models():
    from parallel_models.rl.config.render import render_default_yaml

    with open(default_config_path()) as f:
        packaged = f.read()
    assert packaged == render_default_yaml(), \
        "configs/default.yaml is stale: run python -m parallel_models.rl.config.render"
    # each key's line carries its field's description as a comment
    for section, klass in rlcfg.SECTIONS.items():
        for key, field in klass.model_fields.items():
            assert field.description, f"{section}.{key} has no description"
            assert f"# {field.description}" in packaged, (section, key)


def test_shared_fields_have_one_definition():
    from parallel_models.inference.sampling import SamplingFields, SamplingParams
    from parallel_models.utils.optimizer import OptimConfig, OptimizerFields

    assert issubclass(rlcfg.RolloutSection, SamplingFields)
    assert issubclass(rlcfg.ActorSection, OptimizerFields)
    assert issubclass(rlcfg.CriticSection, OptimizerFields)
    cfg = load_config(None, ["rollout.top_k=5", "rollout.stop_token_ids=[3]", "actor.lr=2e-4",
                             "actor.betas=[0.8, 0.99]", "critic.warmup_steps=3"])
    params = cfg.rollout.sampling_params(seed=7)
    assert isinstance(params, SamplingParams)
    assert (params.n, params.top_k, params.stop_token_ids, params.seed) == (4, 5, [3], 7)
    optim = cfg.actor.optim_config(total_steps=50)
    assert isinstance(optim, OptimConfig)
    assert (optim.lr, optim.betas, optim.total_steps) == (2e-4, (0.8, 0.99), 50)
    assert cfg.critic.optim_config(10).warmup_steps == 3


def test_run_defaults_hold_for_partial_sections(tmp_path):
    """rollout.n and actor/critic.lr default differently from the shared models; a section
    given in a file without them still gets the run's defaults."""
    path = write_yaml(tmp_path / "c.yaml", {"rollout": {"max_new_tokens": 8},
                                             "actor": {"ppo_epochs": 3}})
    cfg = load_config(path, [])
    assert cfg.rollout.n == PPOConfig().rollout.n == 4
    assert cfg.actor.lr == PPOConfig().actor.lr == 1e-3
    assert PPOConfig.model_validate({"critic": {"enable": True}}).critic.lr == 1e-3


def test_sampling_bounds_in_the_config():
    cfg = load_config(None, ["rollout.greedy=true", "rollout.temperature=0"])
    assert cfg.rollout.sampling_params().greedy
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rollout.top_k=-1", "rollout.n=0", "actor.betas=[0.9, 1.5]",
                           "rollout.stop_token_ids=[-2]", "actor.lr=0"])
    msg = str(e.value)
    for words in ("rollout.top_k must be >= 0", "rollout.n must be >= 1", "actor.betas",
                  "rollout.stop_token_ids[0]", "actor.lr must be > 0"):
        assert words in msg, (words, msg)


def test_entrypoint_help_and_resume_flag(capsys, monkeypatch, tmp_path):
    from parallel_models.rl import trainer
    from parallel_models.rl.train import main

    seen = {}

    class Recorder:  # stands in for PPOTrainer: what configuration would the run get?
        def __init__(self, cfg):
            seen["cfg"] = cfg

        def fit(self):
            return []

    monkeypatch.setattr(trainer, "PPOTrainer", Recorder)
    out = tmp_path / "run"
    saved = load_config(None, ["trainer.total_steps=3", f"trainer.output_dir={out}"]).save(
        tmp_path / "run.yaml")
    step = out / "checkpoints" / "step_000002"  # what --resume looks for (run's state, config)
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    load_config(saved).save(step / "config.yaml")
    assert main(["--config", saved, "--resume", "actor.lr=5e-4"]) == 0
    cfg = seen["cfg"]
    assert cfg.trainer.resume and cfg.trainer.total_steps == 3 and cfg.actor.lr == 5e-4

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--resume" in out and "--config" in out and "key=value" in out
    # --resume goes through the same validation: a bad key is reported, exit code 2
    assert main(["--resume", "trainer.total_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'total_steps'" in err
