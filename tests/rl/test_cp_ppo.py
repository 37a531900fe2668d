"""Context parallelism in the RL stack (``parallel.context_parallel_size=2``, gloo ranks):
3 seeded greedy PPO steps (actor, reference and GAE critic all at CP = 2) give the metrics of the
PP = 1, TP = 1 run on one rank (rel <= 1e-5) on 2 ranks, and with PP = 2 or TP = 2 (+ SP) on 4;
the reward model's scores at CP = 2 equal its scores at CP = 1 (fp32, rel <= 1e-5)."""

import pytest
import torch

from parallel_models.testing import run_distributed_jobs, save_tiny_hf_model
from tests.helpers import context_parallel_checks, hybrid_checks
from tests.helpers.hybrid_ppo_runs import SHORT_RUN, assert_same_metrics


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    rm = save_tiny_hf_model(str(root / "rm"), "llama", head="value", seed=2)
    jobs = [(context_parallel_checks.reward_scores, (rm, 1)),
            (context_parallel_checks.reward_scores, (rm, 2)),
            (hybrid_checks.ppo_metrics,
             (str(root / "ppo"), SHORT_RUN + ["parallel.context_parallel_size=2"]))]
    return run_distributed_jobs(jobs, 2, timeout=900)


def test_ppo_at_cp2_equals_one_rank(runs, hybrid_reference):
    got = [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
           for m in runs[2][0]]
    assert any(k.startswith("critic/") for k in got[0]), sorted(got[0])
    assert_same_metrics(got, hybrid_reference, "CP=2 (DP=1)")


def test_reward_model_at_cp2_equals_cp1(runs):
    for cp1, cp2 in zip(runs[0], runs[1]):
        assert cp1.shape == cp2.shape == (len(context_parallel_checks.LENGTHS),)
        assert float((cp2 - cp1).abs().max() / cp1.abs().max()) <= 1e-5, (cp1, cp2)
        assert torch.isfinite(cp1).all()


FOUR_RANK = {"pp2xcp2": ["parallel.pipeline_parallel_size=2"],
             "tp2xcp2": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"]}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp4")
    jobs = [(hybrid_checks.ppo_metrics,
             (str(root / name), SHORT_RUN + ["parallel.context_parallel_size=2", *layout]))
            for name, layout in FOUR_RANK.items()]
    return dict(zip(FOUR_RANK, run_distributed_jobs(jobs, 4, timeout=900)))


@pytest.mark.parametrize("name", FOUR_RANK)
def test_ppo_at_cp2_with_tp_or_pp_equals_one_rank(four_rank_runs, hybrid_reference, name):
    got = [{k: v for k, v in m.items() if not k.startswith(("timing/", "memory/"))}
           for m in four_rank_runs[name][0]]
    assert_same_metrics(got, hybrid_reference, f"{name} on 4 ranks")


@pytest.mark.parametrize("overrides, words", [
    (["parallel.context_parallel_size=2", "parallel.backend=fsdp"],
     ["parallel.context_parallel_size=2", "parallel.backend=megatron"]),
    (["parallel.context_parallel_size=2", "rollout.exact=true"],
     ["parallel.context_parallel_size=2", "rollout.exact"]),
    (["parallel.context_parallel_size=0"], ["parallel.context_parallel_size"]),
])
def test_context_parallel_config_problems_are_named(overrides, words):
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_context_parallel_counts_in_the_world_size():
    from parallel_models.errors import ConfigError
    from parallel_models.rl.config import load_config

    cfg = load_config(None, ["parallel.context_parallel_size=2"], validate=False)
    cfg.validate(world_size=4)  # DP = 2 divides batch 8 and mini-batch 16
    with pytest.raises(ConfigError, match="context_parallel_size = 2"):
        cfg.validate(world_size=3)
    cfg.data.batch_size = 3
    with pytest.raises(ConfigError, match=r"data-parallel size \(2 = world size 4 / 2\)"):
        cfg.validate(world_size=4)


def test_checkpoint_saved_at_cp2_resumes_at_cp1(tmp_path):
    """A trainer checkpoint saved at CP = 2 (2 ranks) after 2 steps resumes at CP = 1 (1 rank):
    the gathered weights and Adam states are bit-exact, and the next step's losses match."""
    import os

    from tests.helpers import trainer_checkpoint_checks as checks
    from tests.helpers.ppo_runs import assert_same_trainer_state

    out2, dump2 = str(tmp_path / "cp2"), str(tmp_path / "dump_cp2")
    saved = run_distributed_jobs([(checks.save_at_step2_then_step,
                                   (out2, dump2, 1, "parallel.context_parallel_size=2"))], 2,
                                 timeout=900)[0][0]
    out1, dump1 = str(tmp_path / "cp1"), str(tmp_path / "dump_cp1")
    resumed = run_distributed_jobs([(checks.resume_then_step,
                                     (out1, saved["path"], dump1, 1,
                                      os.path.join(out2, "builtin_model")))], 1,
                                   timeout=900)[0][0]
    assert resumed["step"] == 2
    assert_same_trainer_state(dump2, dump1)
    want, got = saved["metrics"], resumed["metrics"]
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "reward/mean",
                "returns/mean", "actor/ppo_kl", "kl/actor_ref"):
        assert abs(want[key] - got[key]) <= 1e-5, f"{key}: CP=2 {want[key]} vs CP=1 {got[key]}"
