"""A run's results do not depend on side paths (issue 30 item 10): building the built-in model
into ``output_dir/builtin_model`` draws its weights from its own stream and leaves the process's
random state as it was, so a fresh run and a run whose folder already holds the model agree."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers.ppo_runs import run_metrics, run_ppo

pytestmark = pytest.mark.background_lane  # subprocess-bound: tests/helpers/background_lane.py

QUICK = ["trainer.total_steps=1", "trainer.save_every=0", "trainer.save_hf_at_end=false",
         "trainer.loggers=[jsonl]", "data.batch_size=4", "rollout.max_new_tokens=8"]


def test_building_the_builtin_model_leaves_the_random_state(tmp_path):
    from transformers import AutoModelForCausalLM

    from parallel_models.rl.backends.builtin_model import build_builtin_model, builtin_model_config
    from parallel_models.tokenizer import build_builtin_tokenizer

    tok = build_builtin_tokenizer()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    folder = build_builtin_model(str(tmp_path / "m"), tok, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    # the weights are those of seed 7 (as before: the model the default run trains is unchanged)
    torch.manual_seed(7)
    want = AutoModelForCausalLM.from_config(builtin_model_config(len(tok), tok)).state_dict()
    got = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_run_does_not_depend_on_an_existing_builtin_model(tmp_path):
    fresh = tmp_path / "fresh"
    run_ppo([f"trainer.output_dir={fresh}", *QUICK])
    present = tmp_path / "present"
    present.mkdir()
    shutil.copytree(fresh / "builtin_model", present / "builtin_model")
    run_ppo([f"trainer.output_dir={present}", *QUICK])
    (a,), (b,) = run_metrics(fresh), run_metrics(present)
    differ = {k: (a[k], b.get(k)) for k in a if not k.startswith("timing/") and a[k] != b.get(k)}
    assert not differ, differ
