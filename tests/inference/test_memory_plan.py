"""The rollout memory planner (parallel_models.inference.memory_plan): given the device's memory,
the weights and the model shape -> the KV budget and prefill chunk; the plan never exceeds
``gpu_memory_utilization``; a configuration that cannot fit is refused before any generation,
naming the numbers. The per-token KV size is checked against the pool the engine allocates, and
the planned engine against the static batcher's greedy output (tiny Llama, CPU, the device's
memory simulated by patching ``device_memory``)."""

import pytest
import torch

from parallel_models.inference import memory_plan as mp
from parallel_models.testing import run_distributed

GIB = 1 << 30
# Llama-3-8B at TP=2, bf16: 32 layers, 4096 hidden, 14336 / 2 ffn, 16 / 4 heads per rank
LLAMA8B_TP2 = mp.ModelShape(layers=32, hidden=4096, intermediate=7168, heads=16, kv_heads=4,
                            head_dim=128, vocab=128256, dtype_bytes=2)
H100 = 80 * GIB


def _plan(**kw):
    args = dict(total=H100, in_use=20 * GIB, weights=8 * GIB, utilization=0.9,
                longest_prompt=512, longest_row=1536, rows=512, max_prefill_tokens=16384)
    args.update(kw)
    return mp.plan_memory(LLAMA8B_TP2, **args)


def test_per_token_sizes_of_the_8b_shape():
    # K and V x 32 layers x 4 KV heads x 128 x 2 bytes
    assert mp.kv_bytes_per_token(LLAMA8B_TP2) == 2 * 32 * 4 * 128 * 2 == 65536
    # residual + input + norm (3 x 4096) + the MLP: gate/up 2 x 7168, SiLU + product 2 x 7168,
    # down 4096 (wider than attention's 2 x (16 + 8) x 128 + 16 x 128 + 4096)
    assert mp.activation_bytes_per_token(LLAMA8B_TP2) == 2 * (3 * 4096 + 4 * 7168 + 4096)
    assert mp.sampling_bytes(LLAMA8B_TP2, 8) == 8 * 128256 * 4 * mp.SAMPLING_FLOATS_PER_VOCAB


def test_budget_from_free_memory():
    plan = _plan(in_use=40 * GIB)
    available = int(0.9 * H100) - 40 * GIB
    act = mp.activation_bytes_per_token(LLAMA8B_TP2)
    sampling = mp.sampling_bytes(LLAMA8B_TP2, 512) + 2 * 512 * act
    assert plan.available == available and plan.sampling == sampling
    assert plan.prefill_tokens == 16384  # the default chunk fits in half of what is left
    assert plan.kv_tokens == (available - sampling - 16384 * act) // 65536
    # everything the engine takes stays inside the share it was given
    used = plan.kv_tokens * 65536 + plan.prefill_tokens * act + sampling
    assert 40 * GIB + used <= 0.9 * H100
    assert "GiB" in plan.describe()
    assert _plan(in_use=20 * GIB).kv_tokens == 512 * 1536  # more room: every row at once


def test_budget_capped_at_what_the_rows_use():
    assert _plan(rows=4).kv_tokens == 4 * 1536


def test_prefill_chunk_shrinks_when_memory_is_tight_but_not_below_the_longest_prompt():
    act = mp.activation_bytes_per_token(LLAMA8B_TP2)
    tight = _plan(in_use=int(0.9 * H100) - 2 * GIB, rows=8)
    assert 512 <= tight.prefill_tokens < 16384
    assert tight.prefill_tokens * act <= mp.PREFILL_SHARE * (2 * GIB - tight.sampling)
    assert tight.kv_tokens >= 1536
    tighter = _plan(in_use=int(0.9 * H100) - int(0.16 * GIB), rows=1, longest_prompt=1000,
                    longest_row=1100)
    assert tighter.prefill_tokens == 1000  # the longest prompt is prefilled whole


def test_explicit_budget_is_kept_and_the_chunk_sized_from_the_rest():
    plan = _plan(kv_budget_tokens=100_000)
    assert plan.kv_tokens == 100_000 and plan.prefill_tokens == 16384
    act = mp.activation_bytes_per_token(LLAMA8B_TP2)
    left = plan.available - plan.sampling - 820_000 * 65536
    squeezed = _plan(kv_budget_tokens=820_000)
    assert squeezed.prefill_tokens == max(512, left // act) < 16384


@pytest.mark.parametrize("in_use_gib, util, budget", [(71, 0.9, None), (20, 0.25, None),
                                                      (20, 0.9, 900_000)])
def test_a_plan_that_cannot_fit_names_the_numbers(in_use_gib, util, budget):
    with pytest.raises(mp.MemoryPlanError) as err:
        _plan(in_use=in_use_gib * GIB, utilization=util, kv_budget_tokens=budget)
    msg = str(err.value)
    assert "weights 8.00 GiB" in msg and f"gpu_memory_utilization={util}" in msg
    assert "65536 bytes/token" in msg and "free for the engine" in msg
    if budget:
        assert f"kv_budget_tokens={budget}" in msg
    else:
        assert "1536 tokens (longest prompt 512 + max_new_tokens 1024)" in msg


def test_bad_utilization():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        _plan(utilization=1.5)


def test_no_plan_off_cuda():
    assert mp.device_memory("cpu") is None


def _planned_generation(path: str) -> dict:
    import parallel_models as pm
    from parallel_models.inference import RolloutEngine, SamplingParams
    from parallel_models.inference.continuous import ContinuousEngine

    pm.init_parallel(tensor_parallel_size=1)
    model = pm.AutoModelForCausalLM.from_pretrained(path, rmpad=True, dtype=torch.float32)
    shape = mp.ModelShape.of(model)
    res = {"kv_per_token": mp.kv_bytes_per_token(shape)}
    pool = ContinuousEngine(model, 50, max_rows=2).cache
    res["pool_bytes_per_position"] = 2 * pool.k.numel() * pool.k.element_size() // pool.end
    res["weights"] = mp.weight_bytes(model)
    prompts = [[5, 9, 11, 3], [7, 8], [12, 13, 14, 15, 16, 17]]
    params = SamplingParams(greedy=True, max_new_tokens=6)
    res["static"] = RolloutEngine(model).generate(prompts, params).responses.tolist()
    act = mp.activation_bytes_per_token(shape)
    kv = res["kv_per_token"]
    # a simulated device: room for the weights, 3 rows' sampling and 20 tokens of KV + prefill
    room = mp.sampling_bytes(shape, 3) + 6 * act + 20 * kv + 6 * act
    mp.device_memory = lambda device: (1 << 40, (1 << 40) - room)  # utilization 1: exactly room
    calls = []
    real = model.forward_hidden
    model.forward_hidden = lambda *a, **k: calls.append(1) or real(*a, **k)
    engine = RolloutEngine(model, kv_budget_tokens="auto", gpu_memory_utilization=1.0)
    res["planned"] = engine.generate(prompts, params).responses.tolist()
    res["plan"] = (engine.memory_plan.kv_tokens, engine.memory_plan.prefill_tokens)
    res["forwards_planned"] = len(calls)
    # a device too small for one row of the longest request: refused before any forward
    calls.clear()
    mp.device_memory = lambda device: (1 << 40, (1 << 40) - room // 4)
    try:
        RolloutEngine(model, kv_budget_tokens="auto", gpu_memory_utilization=1.0).generate(
            prompts, params)
        res["refusal"] = None
    except mp.MemoryPlanError as exc:
        res["refusal"] = str(exc)
    res["forwards_refused"] = len(calls)
    return res


@pytest.fixture(scope="module")
def planned(hf_models):
    return run_distributed(_planned_generation, 1, hf_models[("llama", "causal_lm")],
                           timeout=300)[0]


def test_kv_bytes_per_token_is_what_the_pool_allocates(planned):
    assert planned["kv_per_token"] == planned["pool_bytes_per_position"]


def test_planned_engine_generates_what_the_static_batcher_does(planned):
    kv_tokens, chunk = planned["plan"]
    assert 12 <= kv_tokens <= 3 * 12  # at least the longest row (6 + 6), at most every row
    assert chunk >= 6
    assert planned["forwards_planned"] > 0
    assert planned["planned"] == planned["static"]


def test_refused_before_any_generation_with_the_numbers(planned):
    msg = planned["refusal"]
    assert msg is not None and planned["forwards_refused"] == 0
    assert f"{planned['kv_per_token']} bytes/token" in msg
    assert "12 tokens (longest prompt 6 + max_new_tokens 6)" in msg
    assert f"weights {planned['weights'] / GIB:.2f} GiB" in msg
