"""The kernel and engine options (parallel_models/options.py): the defaults are the behaviour the
``PARALLEL_MODELS_*`` environment variables had unset, every former variable is an option, an
environment variable overrides the configured value (validated, logged once), options_override
wins over both, unknown names get a did-you-mean, and no module reads the variables itself."""

import logging
import os
import re

import pytest

from parallel_models import options as opts
from parallel_models.errors import ConfigError
from parallel_models.options import (KernelOptions, env_var, get_options, option,
                                     options_override, parse_assignments, set_options)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each variable's value when unset, as the modules read it before the options existed
# (e.g. ``os.environ.get("PARALLEL_MODELS_COMPILE", "1") == "0"`` -> compile on)
OLD_DEFAULTS = {
    "PARALLEL_MODELS_COMPILE": True,
    "PARALLEL_MODELS_CUDA_GRAPHS": True,
    "PARALLEL_MODELS_DECODE_ATTENTION": "triton",
    "PARALLEL_MODELS_DECODE_FUSE_NORM": True,
    "PARALLEL_MODELS_DECODE_FUSE_ROPE": True,
    "PARALLEL_MODELS_DECODE_KERNEL_CONFIG": None,  # the tuned table / default launch config
    "PARALLEL_MODELS_DECODE_PIPELINE": "auto",  # unset: on CUDA only
    "PARALLEL_MODELS_DECODE_SPLIT": None,  # automatic split size
    "PARALLEL_MODELS_DISABLE_FLASH_ATTN": False,
    "PARALLEL_MODELS_ELEMENTWISE_LAUNCH": {},  # the launch config's own defaults
    "PARALLEL_MODELS_FUSED_DRAW": True,
    "PARALLEL_MODELS_GRAD_BUFFER_KERNEL": True,
    "PARALLEL_MODELS_GRAD_FIRST_WRITE": True,
    "PARALLEL_MODELS_MOE_DEVICE_DISPATCH": True,
    "PARALLEL_MODELS_MOE_GROUPED_GEMM": "auto",  # unset: Hopper+ CUDA with bf16
    "PARALLEL_MODELS_MOE_PACKED_EXPERTS": True,
    "PARALLEL_MODELS_TP_OVERLAP_CHUNKS": 0,
    "PARALLEL_MODELS_TRITON_ELEMENTWISE": False,
    "PARALLEL_MODELS_WGRAD_FUSION": False,
}


@pytest.fixture(autouse=True)
def clean_options(monkeypatch):
    """No option variable of the caller's environment, and the defaults, around each test."""
    def clean():
        for var in opts.ENV_VARS.values():
            monkeypatch.delenv(var, raising=False)
        set_options(None)

    clean()
    yield
    clean()


def test_every_former_variable_is_an_option_with_its_old_default():
    assert set(opts.ENV_VARS.values()) == set(OLD_DEFAULTS)
    current = get_options()
    for name, var in opts.ENV_VARS.items():
        assert getattr(current, name) == OLD_DEFAULTS[var], name
        assert option(name) == OLD_DEFAULTS[var], name
        assert KernelOptions.model_fields[name].description, f"{name} has no description"
    assert "PARALLEL_MODELS_API_KEY" not in opts.ENV_VARS.values()  # a secret, not an option


def test_the_old_values_of_the_variables_still_mean_the_same(monkeypatch):
    """"0" / "1" switch every on/off option; the tri-state ones take auto / 1 / 0."""
    for name, field in KernelOptions.model_fields.items():
        if field.annotation is bool:
            for raw, want in (("0", False), ("1", True)):
                monkeypatch.setenv(env_var(name), raw)
                assert option(name) is want, (name, raw)
    for name in ("decode_pipeline", "moe_grouped_gemm"):
        for raw, want in (("auto", "auto"), ("1", True), ("0", False)):
            monkeypatch.setenv(env_var(name), raw)
            assert option(name) == want, (name, raw)
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_ATTENTION", "aten")
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_SPLIT", "64")
    monkeypatch.setenv("PARALLEL_MODELS_DECODE_KERNEL_CONFIG", "32,8,3,64")
    monkeypatch.setenv("PARALLEL_MODELS_ELEMENTWISE_LAUNCH", "norm_tile=8192, swiglu_block=512")
    monkeypatch.setenv("PARALLEL_MODELS_TP_OVERLAP_CHUNKS", "4")
    assert (option("decode_attention"), option("decode_split"), option("decode_kernel_config"),
            option("elementwise_launch"), option("tp_overlap_chunks")) == \
        ("aten", 64, "32,8,3,64", {"norm_tile": 8192, "swiglu_block": 512}, 4)


def test_env_overrides_the_configured_value_and_is_logged_once(monkeypatch, caplog):
    set_options({"cuda_graphs": True, "decode_split": 32})
    assert option("cuda_graphs") is True and option("decode_split") == 32
    monkeypatch.setenv("PARALLEL_MODELS_CUDA_GRAPHS", "0")
    with caplog.at_level(logging.INFO, logger="parallel_models.options"):
        for _ in range(3):
            assert option("cuda_graphs") is False
        assert get_options().cuda_graphs is False
        assert get_options().decode_split == 32  # the others keep the configured values
    lines = [r.getMessage() for r in caplog.records if "PARALLEL_MODELS_CUDA_GRAPHS" in
             r.getMessage()]
    assert len(lines) == 1, lines
    assert "cuda_graphs" in lines[0] and "False" in lines[0]
    monkeypatch.delenv("PARALLEL_MODELS_CUDA_GRAPHS")
    assert option("cuda_graphs") is True  # read again at each call: unset, the configured value


def test_options_override_wins_over_env_and_config(monkeypatch):
    set_options({"fused_draw": False})
    monkeypatch.setenv("PARALLEL_MODELS_FUSED_DRAW", "0")
    with options_override(fused_draw=True) as current:
        assert current.fused_draw is True and option("fused_draw") is True
        with options_override(fused_draw=False):
            assert option("fused_draw") is False
        assert option("fused_draw") is True
    assert option("fused_draw") is False
    monkeypatch.delenv("PARALLEL_MODELS_FUSED_DRAW")
    assert option("fused_draw") is False  # set_options' value
    assert set_options(None).fused_draw is True


@pytest.mark.parametrize("var,raw,words", [
    ("PARALLEL_MODELS_CUDA_GRAPHS", "maybe", "boolean"),
    ("PARALLEL_MODELS_DECODE_ATTENTION", "cudnn", "'triton' or 'aten'"),
    ("PARALLEL_MODELS_TP_OVERLAP_CHUNKS", "two", "integer"),
    ("PARALLEL_MODELS_TP_OVERLAP_CHUNKS", "-1", "greater than or equal to 0"),
    ("PARALLEL_MODELS_DECODE_SPLIT", "48", "power of two"),
    ("PARALLEL_MODELS_DECODE_KERNEL_CONFIG", "64,4", "block_n,warps,stages"),
    ("PARALLEL_MODELS_ELEMENTWISE_LAUNCH", "tile=1", "norm_tile"),
    ("PARALLEL_MODELS_MOE_GROUPED_GEMM", "sometimes", "auto"),
])
def test_a_bad_env_value_is_a_config_error_naming_the_variable(monkeypatch, var, raw, words):
    name = var.removeprefix("PARALLEL_MODELS_").lower()
    monkeypatch.setenv(var, raw)
    for read in (lambda: option(name), get_options, lambda: set_options(None)):
        with pytest.raises(ConfigError, match=re.escape(f"{var}={raw!r}")) as err:
            read()
        assert words in str(err.value)


def test_unknown_options_get_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown option 'cuda_graph' \(did you mean "
                                          r"'cuda_graphs'\?\)"):
        set_options({"cuda_graph": False})
    with pytest.raises(ConfigError, match=r"'fused_drawing' \(did you mean 'fused_draw'\?\)"):
        with options_override(fused_drawing=False):
            pass
    with pytest.raises(ConfigError, match=r"--option 'compil=0'.*did you mean 'compile'"):
        parse_assignments(["compil=0"])
    with pytest.raises(ConfigError, match="did you mean 'decode_split'"):
        option("decode_splits")
    with pytest.raises(ConfigError, match="expected name=value"):
        parse_assignments(["cuda_graphs"])
    assert parse_assignments(["cuda_graphs=false", "decode_split=64",
                              "elementwise_launch={norm_tile: 8192}"]) == {
        "cuda_graphs": False, "decode_split": 64, "elementwise_launch": {"norm_tile": 8192}}


def test_no_module_reads_the_option_variables_itself():
    """Every ``PARALLEL_MODELS_*`` read goes through parallel_models.options (excepted: the API
    key, a secret, and the test-only fault points of parallel_models/utils/fault_points.py,
    never a run option)."""
    pattern = re.compile(r"environ[^\n]*PARALLEL_MODELS_|getenv\([^\n]*PARALLEL_MODELS_")
    offenders = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "parallel_models")):
        for name in files:
            if not name.endswith(".py") or name == "options.py" and \
                    dirpath == os.path.join(ROOT, "parallel_models"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                for n, line in enumerate(f, 1):
                    if pattern.search(line) and "PARALLEL_MODELS_API_KEY" not in line \
                            and "PARALLEL_MODELS_TEST_FAULT" not in line:
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
