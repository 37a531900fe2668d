"""The rollout server an async run starts (``rl/async_rollout/fleet.py``) is sized for the run:
its limits fit every request, ``rollout.partial`` turns on its partial rollouts and
``rollout.kv_budget_tokens`` (a count, or auto: planned from the server GPU's memory) sizes its
KV pool, which the server's command line accepts."""

from parallel_models.inference.server.cli import build_parser
from parallel_models.rl.async_rollout.fleet import server_options
from parallel_models.rl.config import load_config


def _options(*overrides):
    return server_options(load_config(None, ["trainer.mode=async", "data.batch_size=40",
                                             "rollout.n=4", *overrides]))


def test_server_options_fit_the_run():
    opts = _options("rollout.max_new_tokens=300")
    assert opts[opts.index("--max-batch") + 1] == "160"
    assert opts[opts.index("--max-new-tokens") + 1] == "300"
    assert "--kv-budget-tokens" not in opts and "--partial-rollouts" not in opts  # defaults
    assert "--partial-rollouts" in _options("rollout.partial=true")


def test_kv_budget_reaches_the_server_command_line():
    for budget, parsed in (("auto", "auto"), ("5000", 5000)):
        opts = _options(f"rollout.kv_budget_tokens={budget}")
        assert opts[opts.index("--kv-budget-tokens") + 1] == budget
        args = build_parser().parse_args(["--model", "m", *opts])
        assert args.kv_budget_tokens == parsed


def test_partial_rollouts_take_the_group_push():
    """``rollout.partial`` with ``rollout.weight_push=group`` is accepted (the group push lands
    in flight as the stream and folder pushes do: tests/inference/test_weight_group_push.py)
    and turns on the server's partial rollouts; without ``trainer.mode=async`` it is refused."""
    import pytest

    from parallel_models.rl.config import ConfigError

    over = ["rollout.partial=true", "rollout.weight_push=group"]
    cfg = load_config(None, ["trainer.mode=async", *over])
    assert cfg.rollout.partial and cfg.rollout.weight_push == "group"
    assert "--partial-rollouts" in server_options(cfg)
    with pytest.raises(ConfigError, match="rollout.partial=true needs trainer.mode=async"):
        load_config(None, over)


def test_fp8_kv_cache_reaches_the_server_command_line():
    assert "--kv-cache-dtype" not in _options()  # default: the server's (the model dtype)
    opts = _options("rollout.kv_cache_dtype=fp8")
    assert build_parser().parse_args(["--model", "m", *opts]).kv_cache_dtype == "fp8"
