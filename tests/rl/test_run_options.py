"""The PPO config's ``kernels`` section (parallel_models.options) in a real run of the built-in
job: every option that used to be a ``PARALLEL_MODELS_*`` environment variable is written to the
run's ``config.yaml``, with the values that ran (the config's, and an environment variable's
over it, which the log names); a bad variable stops the run naming it."""

import os

import yaml

from tests.helpers.ppo_runs import ENV, run_metrics, run_ppo

FORMER_VARIABLES = ("COMPILE", "CUDA_GRAPHS", "DECODE_ATTENTION", "DECODE_FUSE_NORM",
                    "DECODE_FUSE_ROPE", "DECODE_KERNEL_CONFIG", "DECODE_PIPELINE", "DECODE_SPLIT",
                    "DISABLE_FLASH_ATTN", "ELEMENTWISE_LAUNCH", "FUSED_DRAW", "GRAD_BUFFER_KERNEL",
                    "GRAD_FIRST_WRITE", "MOE_DEVICE_DISPATCH", "MOE_GROUPED_GEMM",
                    "MOE_PACKED_EXPERTS", "TP_OVERLAP_CHUNKS", "TRITON_ELEMENTWISE",
                    "WGRAD_FUSION")
TINY = ["trainer.total_steps=1", "actor.ppo_epochs=1", "data.batch_size=4", "rollout.n=2",
        "actor.mini_batch_size=8", "rollout.max_new_tokens=8", "trainer.save_every=0",
        "trainer.save_hf_at_end=false", "trainer.loggers=[jsonl]"]


def _env(**overrides):
    env = {k: v for k, v in ENV.items() if not k.startswith("PARALLEL_MODELS_")}
    env.update({f"PARALLEL_MODELS_{k}": v for k, v in overrides.items()})
    return env


def test_config_yaml_records_every_option_with_env_overrides(tmp_path):
    out = str(tmp_path / "run")
    proc = run_ppo([f"trainer.output_dir={out}", *TINY, "kernels.decode_fuse_norm=false",
                    "kernels.decode_split=64"],
                   env=_env(FUSED_DRAW="0", TP_OVERLAP_CHUNKS="2"))
    assert len(run_metrics(out)) == 1
    with open(os.path.join(out, "config.yaml")) as f:
        kernels = yaml.safe_load(f)["kernels"]
    assert set(kernels) == {v.lower() for v in FORMER_VARIABLES}
    want = {"fused_draw": False, "tp_overlap_chunks": 2,  # the environment's
            "decode_fuse_norm": False, "decode_split": 64,  # the config's
            "compile": True, "cuda_graphs": True, "decode_pipeline": "auto",  # defaults
            "moe_grouped_gemm": "auto", "decode_kernel_config": None, "elementwise_launch": {}}
    assert {k: kernels[k] for k in want} == want
    assert "PARALLEL_MODELS_FUSED_DRAW=0 sets the option fused_draw to False" in proc.stderr
    assert "PARALLEL_MODELS_TP_OVERLAP_CHUNKS=2 sets the option tp_overlap_chunks" in proc.stderr
    assert "PARALLEL_MODELS_API_KEY" not in open(os.path.join(out, "config.yaml")).read()


def test_a_bad_variable_stops_the_run_naming_it(tmp_path):
    proc = run_ppo([f"trainer.output_dir={tmp_path / 'run'}", *TINY], check=False,
                   env=_env(CUDA_GRAPHS="sometimes"))
    assert proc.returncode == 2
    assert "PARALLEL_MODELS_CUDA_GRAPHS='sometimes'" in proc.stderr
    proc = run_ppo([f"trainer.output_dir={tmp_path / 'run2'}", *TINY, "kernels.cuda_graph=false"],
                   check=False, env=_env())
    assert proc.returncode == 2
    assert "unknown key 'kernels.cuda_graph' (did you mean 'cuda_graphs'?)" in proc.stderr


def test_the_kernels_section_becomes_the_process_options(tmp_path, monkeypatch):
    """``parallel-models-ppo`` (the main every rank runs) makes the config's ``kernels`` the
    process's options before the trainer is built, environment variables over them, and hands
    the trainer the config with the values that run."""
    from parallel_models import options
    from parallel_models.rl import train, trainer

    seen = {}

    class Recorder:
        def __init__(self, cfg):
            seen["cfg"] = cfg.kernels.model_dump()
            seen["process"] = options.get_options().model_dump()

        def fit(self):
            return []

    monkeypatch.setattr(trainer, "PPOTrainer", Recorder)
    for var in options.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PARALLEL_MODELS_MOE_GROUPED_GEMM", "1")
    try:
        assert train.main([f"trainer.output_dir={tmp_path}", "kernels.cuda_graphs=false",
                           "kernels.moe_grouped_gemm=false"]) == 0
    finally:
        options.set_options(None)
    assert seen["cfg"] == seen["process"]
    assert (seen["process"]["cuda_graphs"], seen["process"]["moe_grouped_gemm"]) == (False, True)
