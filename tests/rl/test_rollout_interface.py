"""The rollout interface (parallel_models/rl/rollout/interface.py): every adapter satisfies the
protocol, the in-process and HF-generate adapters (and the hybrid engine in the training layout)
generate what transformers' ``generate`` does, the rollout and training backend registries check
names like the config's other errors, and a rollout backend registered by a user drives a PPO run
with the built-in one's metrics."""

from __future__ import annotations

import pytest

from parallel_models.errors import ConfigError
from parallel_models.testing import run_distributed
from tests.helpers import rollout_interface_checks as checks


@pytest.fixture(scope="module")
def generated(hf_models, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("push"))
    return run_distributed(checks.adapters_generate, 1, hf_models[("llama", "causal_lm")],
                           folder)[0]


def test_every_adapter_satisfies_the_protocol(generated):
    assert generated["protocol"] == {"inprocess": True, "hybrid": True, "hf_generate": True,
                                     "server": True}
    assert generated["not_a_rollout"] is False  # a bare engine has another interface


@pytest.mark.parametrize("name", ["inprocess", "hybrid", "hf_generate"])
def test_adapter_generates_like_transformers(generated, name):
    """Greedy rows (2 per prompt, prompt-major) equal transformers' greedy continuation, in the
    trainer's batch layout (left-padded prompts, right-padded responses, group index)."""
    got = generated[name]
    assert got["type"] == "RolloutBatch"
    assert got["group_index"] == [0, 0, 1, 1, 2, 2]
    for row, r in enumerate(got["rows"]):
        i = row // 2
        assert r["prompt"] == checks.PROMPTS[i]
        assert set(r["left_pad"]) <= {0}
        assert r["response"] == generated["reference"][i], (name, row)


@pytest.mark.parametrize("name", ["inprocess", "hybrid"])
def test_sampler_log_probs_match_transformers(generated, name):
    """Our engine returns the sampler's log-probs (transformers' log-softmax at the chosen
    tokens, float32, within 1e-4); HF generate has none to return (zeros)."""
    for row, r in enumerate(generated[name]["rows"]):
        want = generated["reference_log_probs"][row // 2]
        assert r["log_probs"] == pytest.approx(want, abs=1e-4), (name, row)
    assert all(v == 0.0 for r in generated["hf_generate"]["rows"] for v in r["log_probs"])


def test_seeded_samples_are_the_same_through_every_adapter(generated):
    """Per-prompt seeds (issue 30, item 11): the static and continuous in-process engine, the
    hybrid engine and transformers' generate (the fsdp fallback) draw the same sampled tokens,
    and a prompt generated alone draws what it draws among the others."""
    seeded = generated["seeded"]
    want = seeded["inprocess"]
    assert len(want) == 3 * len(checks.PROMPTS)
    assert len({tuple(r) for r in want[:3]}) > 1, "the samples of a prompt are all equal"
    for name in ("inprocess", "continuous", "hybrid", "hf_generate"):
        assert seeded[name] == want, name
        assert seeded[name + "_alone"] == want, f"{name}: the batch changed the samples"


def test_registries_check_names_and_suggest():
    from parallel_models.rl.backends.registry import TRAINING_BACKENDS, training_backend
    from parallel_models.rl.config import load_config
    from parallel_models.rl.rollout.registry import ROLLOUT_BACKENDS

    assert {"inprocess", "server"} <= set(ROLLOUT_BACKENDS.names())
    assert {"megatron", "fsdp"} <= set(TRAINING_BACKENDS.names())
    with pytest.raises(ConfigError, match=r"rollout\.backend.*did you mean 'server'"):
        load_config(None, ["rollout.backend=sever"])
    with pytest.raises(ConfigError, match=r"parallel\.backend='fsdb'.*did you mean 'fsdp'"):
        training_backend("fsdb")
    for name in TRAINING_BACKENDS.names():  # each entry has the three functions
        training_backend(name)


def test_user_registered_rollout_backend_runs_ppo_like_the_builtin(tmp_path):
    """A rollout backend registered by name (wrapping the built-in in-process engine) is
    accepted by the config, gets the trainer's calls through the interface, and gives the same
    metrics as ``rollout.backend=inprocess``."""
    builtin = run_distributed(checks.ppo_with_rollout_backend, 1, str(tmp_path / "builtin"),
                              "inprocess", [])[0]
    mine = run_distributed(checks.ppo_with_rollout_backend, 1, str(tmp_path / "mine"),
                           "recording", [])[0]
    assert mine["rollout"] == "RecordingRollout" and builtin["rollout"] == "InProcessRollout"
    assert mine["metrics"] == builtin["metrics"]
    # the weights' versions follow the steps; a generate per step
    assert mine["calls"] == [("update_weights", 0), ("generate", 4, 2), ("update_weights", 1),
                             ("generate", 4, 2), ("update_weights", 2)]
