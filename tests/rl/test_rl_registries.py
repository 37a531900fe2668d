"""Registries of what users extend (rl/registry.py): built-in names, did-you-mean
errors, a user's functions from a file outside the package (loaded once, checked for their
signature, errors naming the config key), needs_critic / critic.enable agreement, and a short PPO
job whose advantage estimator and policy loss come from user files and give the built-ins'
metrics."""

import textwrap

import pytest
import torch

from parallel_models.errors import ConfigError
from parallel_models.rl.algorithms import core as algos
from parallel_models.rl.algorithms.estimators import ADVANTAGE_ESTIMATORS, needs_critic
from parallel_models.rl.algorithms.losses import POLICY_LOSSES, compute_policy_loss
from parallel_models.rl.registry import Registry
from parallel_models.rl.config import load_config
from parallel_models.rl.rewards.rules import REWARD_FUNCTIONS, math_reward
from tests.helpers.ppo_runs import run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

# GRPO written again by a user, from torch only: summed reward per response, minus its group's
# mean, over the group's unbiased std + 1e-6; a group of one gets 0
USER_GRPO = '''
import torch

def grpo(token_level_rewards, response_mask, values, group_index, config):
    mask = response_mask > 0
    zero = torch.zeros((), dtype=token_level_rewards.dtype)
    scores = torch.where(mask, token_level_rewards, zero).sum(dim=-1)
    _, inverse = torch.unique(group_index, return_inverse=True)
    groups = int(inverse.max()) + 1
    count = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))
    mean = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, scores) / count.clamp_min(1)
    dev = scores - mean[inverse]
    var = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, dev * dev)
    std = torch.sqrt(var / (count - 1).clamp_min(1))
    adv = torch.where(count[inverse] > 1, dev / (std[inverse] + 1e-6), torch.zeros_like(dev))
    adv = torch.where(mask, adv.unsqueeze(-1), zero)
    return adv, adv.clone()

grpo.needs_groups = True
'''

# the clipped, dual-clip PPO loss written again by a user (token-mean aggregation only)
USER_PPO = '''
import torch

def ppo(log_probs, old_log_probs, advantages, response_mask, config, token_weights):
    assert config.loss_agg_mode == "token-mean" and token_weights is None
    mask = response_mask > 0
    zero = torch.zeros((), dtype=log_probs.dtype)
    log_ratio = torch.where(mask, log_probs - old_log_probs, zero)
    adv = torch.where(mask, advantages.to(log_probs.dtype), zero)
    n = mask.sum().clamp_min(1)
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    plain = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - config.clip_ratio_low, 1.0 + config.clip_ratio_high)
    worst = torch.maximum(plain, clipped)
    cap = -adv * config.clip_ratio_c
    loss = torch.where(adv < 0, torch.minimum(worst, cap), worst)
    frac = lambda b: torch.where(mask, b.to(log_probs.dtype), zero).sum() / n
    metrics = {"pg_clipfrac": frac(clipped > plain),
               "pg_clipfrac_lower": frac((adv < 0) & (worst > cap)),
               "ppo_kl": torch.where(mask, -log_ratio, zero).sum() / n}
    return torch.where(mask, loss, zero).sum() / n, {k: v.detach() for k, v in metrics.items()}

ppo.metrics = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
'''


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    return str(e.value)


def test_builtins_are_registered_by_name():
    assert {"gae", "grpo", "rloo"} <= set(ADVANTAGE_ESTIMATORS.names())
    assert set(algos.KL_PENALTY_KINDS) <= set(algos.KL_ESTIMATORS.names())
    assert "ppo" in POLICY_LOSSES and "math_reward" in REWARD_FUNCTIONS
    assert REWARD_FUNCTIONS.get("math_reward") is math_reward
    attribute = ADVANTAGE_ESTIMATORS.attribute
    assert attribute(ADVANTAGE_ESTIMATORS.get("gae"), "needs_critic")
    assert not attribute(ADVANTAGE_ESTIMATORS.get("grpo"), "needs_critic")
    assert attribute(ADVANTAGE_ESTIMATORS.get("rloo"), "needs_groups")
    # aliases are one function; the registered KL estimators are the formulas of kl_penalty
    assert algos.KL_ESTIMATORS.get("mse") is algos.KL_ESTIMATORS.get("k2")
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    assert torch.equal(algos.kl_penalty(lp, ref, "low_var_kl"), torch.exp(ref - lp) - (ref - lp) - 1)


def test_unknown_names_and_registration_errors():
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'gea' \(did you mean "
                                          r"'gae'\?\); registered: gae, gpg, grpo, opo, "
                                          r"reinforce_plus_plus, reinforce_plus_plus_baseline, "
                                          r"remax, rloo;"):
        ADVANTAGE_ESTIMATORS.get("gea")
    message = _error(["actor.policy_loss=ppp"])
    assert "actor.policy_loss" in message and "did you mean 'ppo'" in message
    message = _error(["actor.kl_loss_type=low_var"])
    assert "actor.kl_loss_type" in message and "did you mean 'low_var_kl'" in message
    registry = Registry("thing", params=("x",), defaults={"flag": False})
    registry.register("a", flag=True)(lambda x: x)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda x: x)
    with pytest.raises(TypeError, match="unknown attributes"):
        registry.register("b", colour="red")


def test_user_file_errors_name_the_key(tmp_path):
    missing = tmp_path / "absent.py"
    message = _error([f"algorithm.adv_estimator={missing}:fn"])
    assert "algorithm.adv_estimator" in message and "not found" in message
    good = _write(tmp_path, "est.py", USER_GRPO)
    message = _error([f"algorithm.adv_estimator={good}:no_such_fn"])
    assert "no attribute 'no_such_fn'" in message and "grpo" in message
    wrong = _write(tmp_path, "wrong.py", "def est(rewards, mask):\n    return rewards, rewards\n")
    message = _error([f"algorithm.adv_estimator={wrong}:est"])
    assert "algorithm.adv_estimator" in message and "token_level_rewards" in message
    message = _error([f"actor.policy_loss={wrong}:est"])
    assert "actor.policy_loss" in message and "old_log_probs" in message
    broken = _write(tmp_path, "broken.py", "raise RuntimeError('boom')\n")
    message = _error([f"algorithm.kl_penalty={broken}:kl"])
    assert "algorithm.kl_penalty" in message and "RuntimeError: boom" in message


def test_user_file_is_loaded_once_and_kl_estimator_from_file(tmp_path):
    log = tmp_path / "loads.txt"
    kl = _write(tmp_path, "kl.py", f'''
        open({str(log)!r}, "a").write("loaded\\n")

        def half_square(log_probs, ref_log_probs):
            return 0.5 * (log_probs - ref_log_probs) ** 2
    ''')
    spec = f"{kl}:half_square"
    for _ in range(2):
        cfg = load_config(None, [f"algorithm.kl_penalty={spec}", f"actor.kl_loss_type={spec}"])
    assert cfg.algorithm.kl_penalty == spec
    lp, ref = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert torch.equal(algos.kl_penalty(lp, ref, spec), algos.kl_penalty(lp, ref, "k2"))
    assert log.read_text() == "loaded\n"


def test_needs_critic_and_critic_enable_agree(tmp_path):
    assert needs_critic(load_config(None, []))  # default: gae, critic.enable unset
    grpo = ["algorithm.adv_estimator=grpo"]
    assert not needs_critic(load_config(None, grpo))
    assert not needs_critic(load_config(None, grpo + ["critic.enable=false"]))
    assert needs_critic(load_config(None, ["critic.enable=true"]))
    message = _error(grpo + ["critic.enable=true"])
    assert "critic.enable=true" in message and "adv_estimator=grpo uses no critic" in message
    message = _error(["critic.enable=false"])
    assert "adv_estimator=gae needs a critic" in message
    # a user's estimator declares what it needs
    est = _write(tmp_path, "gae_like.py", '''
        from parallel_models.rl.algorithms.core import compute_gae

        def gae(token_level_rewards, response_mask, values, group_index, config):
            return compute_gae(token_level_rewards, values, response_mask, config.gamma,
                               config.lam, whiten=False)

        gae.needs_critic = True
    ''')
    assert needs_critic(load_config(None, [f"algorithm.adv_estimator={est}:gae"]))
    assert "needs a critic" in _error([f"algorithm.adv_estimator={est}:gae",
                                       "critic.enable=false"])
    grouped = _write(tmp_path, "grouped.py", USER_GRPO)
    message = _error([f"algorithm.adv_estimator={grouped}:grpo", "rollout.n=1",
                      "actor.mini_batch_size=8"])
    assert "rollout.n >= 2" in message


def test_user_policy_loss_matches_the_builtin_on_a_batch(tmp_path):
    from types import SimpleNamespace

    spec = _write(tmp_path, "loss.py", USER_PPO) + ":ppo"
    user = POLICY_LOSSES.get(spec)
    torch.manual_seed(0)
    old = torch.randn(4, 7, dtype=torch.float64)
    new = (old + 0.4 * torch.randn(4, 7, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(4, 7, dtype=torch.float64)
    mask = (torch.rand(4, 7) > 0.3).float()
    cfg = SimpleNamespace(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          loss_agg_mode="token-mean")
    loss, metrics = user(log_probs=new, old_log_probs=old, advantages=adv, response_mask=mask,
                         config=cfg, token_weights=None)
    want, want_metrics = compute_policy_loss(old, new, adv, mask, 0.2, 0.28, 3.0)
    assert metrics.keys() == want_metrics.keys()
    assert abs(loss.item() - want.item()) < 1e-12
    for k in metrics:
        assert abs(metrics[k].item() - want_metrics[k].item()) < 1e-12, k


def test_ppo_job_with_a_users_estimator_and_loss_matches_the_builtins(tmp_path):
    """Three GRPO steps of the built-in model: the user's GRPO and PPO loss (files outside the
    package) give the built-ins' metrics exactly (same formulas, same order of operations)."""
    calls = tmp_path / "calls.txt"  # each call of a user function leaves a line
    logged = ("\ndef logged(fn, name):\n"
              "    def call(**kw):\n"
              f"        open({str(calls)!r}, 'a').write(name + '\\n')\n"
              "        return fn(**kw)\n"
              "    call.__dict__.update(fn.__dict__)\n"
              "    return call\n")
    est = _write(tmp_path, "est.py", USER_GRPO + logged + "grpo = logged(grpo, 'est')\n")
    loss = _write(tmp_path, "loss.py", USER_PPO + logged + "ppo = logged(ppo, 'loss')\n")
    common = ["trainer.total_steps=3", "trainer.save_every=0", "trainer.loggers=[jsonl]",
              "trainer.save_hf_at_end=false", "data.batch_size=4", "actor.mini_batch_size=8",
              "actor.ppo_epochs=1"]
    builtin, user = str(tmp_path / "builtin"), str(tmp_path / "user")
    run_ppo([f"trainer.output_dir={builtin}", "algorithm.adv_estimator=grpo", *common])
    run_ppo([f"trainer.output_dir={user}", f"algorithm.adv_estimator={est}:grpo",
             f"actor.policy_loss={loss}:ppo", *common])
    want, got = run_metrics(builtin), run_metrics(user)
    lines = calls.read_text().split()
    # once per step each; once per microbatch (several per step) and ppo epoch
    assert lines.count("est") == 3 and lines.count("loss") >= 3, lines
    assert len(want) == len(got) == 3
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        assert "critic/vf_loss" not in a
        for key in a:
            if not key.startswith("timing/"):
                assert b[key] == a[key], (a["step"], key, a[key], b[key])


def test_backend_style_registry_lazy_entries_and_names_only():
    """``add`` takes an object or a lazy ``module[:attr]`` reference (imported on first get);
    a registry with ``user_functions=False`` refuses ``file.py:fn`` and names its config key."""
    reg = Registry("thing", key="section.thing", user_functions=False, home="tests.REG")
    reg.add("join", "os.path:join")
    reg.add("obj", len)
    assert reg.names() == ["join", "obj"] and reg.problem("obj") is None
    assert reg._entries["join"] == "os.path:join"  # nothing imported yet
    import os.path
    assert reg.get("join") is os.path.join and reg.get("obj") is len
    assert "did you mean 'join'" in reg.problem("jion")
    assert "add your own with tests.REG.add" in reg.problem("my.py:fn")
    with pytest.raises(ConfigError, match=r"section\.thing='my\.py:fn': unknown thing"):
        reg.get("my.py:fn")


# ReMax and CISPO with Dr. GRPO's aggregation written again by a user, from torch only; the
# estimator declares that it needs the greedy baseline, as the built-in remax does
USER_REMAX = '''
import torch

def remax(token_level_rewards, response_mask, values, group_index, config,
          reward_baselines=None):
    mask = response_mask > 0
    zero = torch.zeros((), dtype=token_level_rewards.dtype)
    rewards = torch.where(mask, token_level_rewards, zero)
    returns = torch.where(mask, rewards.flip(-1).cumsum(-1).flip(-1), zero)
    adv = torch.where(mask, returns - reward_baselines.unsqueeze(-1), zero)
    return adv, returns

remax.needs_greedy_baseline = True
'''

USER_CISPO = '''
import torch

def cispo(log_probs, old_log_probs, advantages, response_mask, config, token_weights):
    assert config.loss_agg_mode == "seq-mean-token-sum-norm" and token_weights is None
    mask = response_mask > 0
    zero = torch.zeros((), dtype=log_probs.dtype)
    log_ratio = torch.where(mask, log_probs - old_log_probs, zero).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    adv = torch.where(mask, advantages.to(log_probs.dtype), zero)
    per_token = -weight.detach() * adv * torch.where(mask, log_probs, zero)
    nonempty = mask.any(-1)
    loss = per_token.sum(-1)[nonempty].sum() / nonempty.sum().clamp_min(1) / mask.shape[-1]
    n = mask.sum().clamp_min(1)
    metrics = {"pg_clipfrac": torch.where(mask, (ratio != weight).to(ratio.dtype), zero).sum() / n,
               "ppo_kl": torch.where(mask, -log_ratio, zero).sum() / n}
    return loss, {k: v.detach() for k, v in metrics.items()}

cispo.metrics = ("pg_clipfrac", "ppo_kl")
'''


def test_users_remax_and_cispo_get_the_builtins_baseline_aggregation_and_metrics(tmp_path):
    """A user's estimator that declares needs_greedy_baseline gets the trainer's greedy rollout,
    and a user's loss is weighed over microbatches by its aggregation's denominator like the
    built-ins: two steps equal the built-in remax + cispo with seq-mean-token-sum-norm."""
    est = _write(tmp_path, "est.py", USER_REMAX) + ":remax"
    loss = _write(tmp_path, "loss.py", USER_CISPO) + ":cispo"
    common = ["trainer.total_steps=2", "trainer.save_every=0", "trainer.loggers=[jsonl]",
              "trainer.save_hf_at_end=false", "data.batch_size=4", "actor.mini_batch_size=8",
              "actor.ppo_epochs=1", "rollout.max_new_tokens=8", "critic.enable=false",
              "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.micro_batch_tokens=128"]
    builtin, user = str(tmp_path / "builtin"), str(tmp_path / "user")
    run_ppo([f"trainer.output_dir={builtin}", "algorithm.adv_estimator=remax",
             "actor.policy_loss=cispo", *common])
    run_ppo([f"trainer.output_dir={user}", f"algorithm.adv_estimator={est}",
             f"actor.policy_loss={loss}", *common])
    want, got = run_metrics(builtin), run_metrics(user)
    assert len(want) == len(got) == 2
    for a, b in zip(want, got):
        assert a.keys() == b.keys()
        assert "reward/greedy_baseline_mean" in a and "actor/pg_clipfrac" in a
        for key in a:
            if not key.startswith("timing/"):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
