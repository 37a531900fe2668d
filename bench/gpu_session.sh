#!/usr/bin/env bash
# One GPU-host session of checks (run from the repository root with the wheels in .whl/):
#   bash bench/gpu_session.sh gpu      # tests/gpu (marker gpu) and bench/moe_bench.py
#   bash bench/gpu_session.sh liger    # bench/liger_bench.py: ours vs transformers vs + Liger
#   bash bench/gpu_session.sh replay   # bench/router_replay_bench.py: MoE rollout vs training
#   bash bench/gpu_session.sh decode   # decode speed (issue 17 item 4), <= ~200 s:
#                                      # bench/decode_profile.py (ours / no_fused_rope /
#                                      # aten_attention / baseline),
#                                      # bench/decode_attention_sweep.py (45 s budget), GPU tests
#   bash bench/gpu_session.sh decode_bench  # rollout_bench.py --cases decode (engine vs baseline)
#   bash bench/gpu_session.sh exact    # exact mode (issue 15 item 4): its GPU test (bitwise
#                                      # rollout == training) and bench/exact_mode_bench.py
#   bash bench/gpu_session.sh wgrad    # fused weight-gradient accumulation: its GPU test and
#                                      # tp_bench TP=1 (8B shape, DDP buffers) fused vs unfused
#   bash bench/gpu_session.sh elementwise  # Triton SwiGLU / RMSNorm kernels, ~4 min: their
#                                      # tests on CUDA, bench/elementwise_bench.py --sweep,
#                                      # tp_bench TP=1 (8B shape) kernels vs compiled alternated
#   bash bench/gpu_session.sh firstwrite  # DDP buffers written by a step's first backward, ~8 min:
#                                      # its GPU test, tp_bench TP=1 (8B shape, every step starts
#                                      # with zero_grad_buffer) first write vs zeroed + adds
#                                      # alternated, then the newest CPU tests on megatron-core 0.19
#   bash bench/gpu_session.sh mcore    # CPU tests of the newest layers on the host's Python 3.12
#                                      # with megatron-core 0.19 (GPU hidden: gloo on the CPU)
#   bash bench/gpu_session.sh tp_pp    # issue 19 item 2 on 2 GPUs, ~5 min: tp_bench TP=1, TP=2
#                                      # (overlap off, k=2 + kernel table, k=4, k=2 with
#                                      # CUDA_DEVICE_MAX_CONNECTIONS=1), TP=2+SP (off, k=2),
#                                      # pp_bench PP=2 x 16 microbatches (16/16, 17/15, 15/17)
#   bash bench/gpu_session.sh fp8      # issue 37, one GPU, <= 9 min: fp8_gemm_sweep (8B, 64 and
#                                      # 256 rows, the three decode kernels), fp8_decode (8B,
#                                      # batch 64, block scales, bf16 vs each kernel), GPU test
#   bash bench/gpu_session.sh fp8_channel  # the decode step with channel scales, <= 4 min
#   bash bench/gpu_session.sh fp8prof  # issue 37, one GPU, ~1 min: Nsight Compute's counters of the
#                                      # decode GEMMs (bench/fp8_kernel_profile.py) and the 8B
#                                      # decode step by category, bf16 and FP8 (decode_profile)
#   bash bench/gpu_session.sh fp8tma   # issue 37, one GPU, ~8 min: the TMA W8A8 decode kernel's
#                                      # GPU tests, its sweep (8B, 64 rows) and the 8B decode
#                                      # step at batch 64, weight-only vs TMA
#   bash bench/gpu_session.sh fp8tma_h100  # issue 37, one GPU, ~9 min: the FP8 GPU tests, the
#                                      # 8B decode step at batch 64 / 256, weight-only vs TMA
#                                      # (64-row and 256-row decode)
#   bash bench/gpu_session.sh fp8tma_089  # issue 37, one GPU, ~9 min: the FP8 GPU tests with the
#                                      # TMA default, the 0.89B decode step at batch 64 / 256 and
#                                      # the GRPO workload, weight-only vs TMA
#   bash bench/gpu_session.sh fp8_256  # issue 37, one GPU, <= 9 min: the decode step FP8 (channel
#                                      # scales, the default) vs bf16 at batch 64 and 256 (0.89B,
#                                      # 8B) and the GRPO-shaped workload both ways (0.89B)
#   bash bench/gpu_session.sh fp8graph # issue 37, one GPU, <= 7.5 min: the tuner's second pass
#                                      # (inference/fp8/graph_tuning.py): its GPU test, the 8B
#                                      # decode step at batch 64 without it / with it (the
#                                      # default) in one process (comparisons, the pass's time)
#   bash bench/gpu_session.sh fp8graph_timeline  # <= 3 min: the 8B graph timeline (pass on)
#   bash bench/gpu_session.sh fp8table # issue 37, <= 9.5 min: the acceptance table with today's
#                                      # defaults: FP8 vs bf16 at batch 64 / 256, 0.89B and 8B,
#                                      # and the GRPO-shaped workload (0.89B)
#   bash bench/gpu_session.sh fp8promote  # issue 37, one GPU, <= 9.5 min: the FP8 MMA promoted
#                                      # every 128 inputs (promote128) vs never (promote0, the
#                                      # default since session 25; tuned as listed first):
#                                      # the TMA kernel tests on CUDA, the gate_up / down graph probe with the
#                                      # errors, the 8B decode step at batch 64 both ways
#   bash bench/gpu_session.sh fp8promote2  # <= 8 min: the 0.89B FP8-vs-bf16 mismatch test with
#                                      # promotion every 128 / never, the 8B step at batch 64
#                                      # with the tuner run never promoting (listed first)
#   bash bench/gpu_session.sh fp8_kv   # the FP8 KV pool (rollout.kv_cache_dtype=fp8), <= 6 min:
#                                      # its GPU-side tests, the 8B decode step at batch 64 and
#                                      # 256, bf16 / FP8 linears x model-dtype / e4m3 KV pool
#   bash bench/gpu_session.sh async    # issue 35, 2 GPUs, ~8 min: async_grpo long-tail, sync vs
#                                      # async k=3 with the group weight push
#   bash bench/gpu_session.sh critic   # issue 33, 2 GPUs, ~15 min, longer than one device call:
#                                      # the 8B PPO + LoRA critic at TP=2 started in a session of
#                                      # its own (it outlives the call), then waited on ~9 min;
#   bash bench/gpu_session.sh poll [S] # the next call: wait on it up to S s (560), print, copy
#                                      # (if the report is missing: grpo_scale.py --from-metrics)
#   bash bench/gpu_session.sh pp2trace # issue 33, 2 GPUs, ~8 min: 8B GRPO at PP=2 with the
#                                      # memory trace (what grows 128 MiB a step)
# Logs and JSON go to $OUT (default /tmp/pm_gpu_out); the background run's to /tmp/pm_bg.
set -uo pipefail
OUT=${OUT:-/tmp/pm_gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
BG=/tmp/pm_bg
wait_bg() {  # wait up to $1 s for the background run to end; print its progress; copy its
    # report, its metrics.jsonl and its log without progress bars or warnings to $OUT (the raw
    # log, 93 MB in session 16, is too large to come back)
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && pgrep -f "bench/grpo_scale.py" > /dev/null; do sleep 10; done
    tr '\r' '\n' < "$BG/run.log" | grep -v "it/s\]\|s/it\]\|torch/_dynamo" \
        | tail -c 4000000 > "$OUT/run_filtered.log"
    grep -E "step [0-9]+/|phase|\| |case|exit|over" "$OUT/run_filtered.log" | tail -30
    cp "$BG"/*.json "$OUT"/ 2>/dev/null
    find "$BG/root" -name metrics.jsonl -exec cp {} "$OUT/" \; 2>/dev/null
    pgrep -f "bench/grpo_scale.py" > /dev/null && echo "still running" || echo "finished"
}
case "${1:-gpu}" in
  fp8)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 220 python3 bench/fp8_gemm_sweep.py --shapes 8b --rows 64 256 --out "$OUT/sweep.json" \
        2>&1 | grep -E '"best"|"layer"' | tail -30
    timeout 200 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales block \
        2>&1 | tee "$OUT/fp8_decode_block.log" | tail -6
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_rollout.py \
        tests/inference/test_fp8_dynamic_act.py tests/inference/test_split_kv_fp8.py 2>&1 \
        | tee "$OUT/fp8_tests.log" | tail -15
    ;;
  fp8prof)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 300 "$NCU" --clock-control none --profile-from-start off --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section LaunchStats python3 bench/fp8_kernel_profile.py > "$OUT/ncu.txt" 2>&1
    grep -E "rows 64:|^  [a-zA-Z_].*\(|Duration|DRAM Throughput|SM Active Cycles|Warp Cycles Per \
Issued" "$OUT/ncu.txt" | cut -c1-120
    S="--hidden 4096 --layers 32 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256"
    for m in "" "--fp8 channel"; do
      timeout 280 python3 bench/decode_profile.py $S --batches 64 --prompt 128 --new 64 \
          --variants ours --steps 10 $m 2>&1 | grep -A24 "### batch" | head -24
    done
    ;;
  fp8tma)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_rollout.py \
        tests/inference/test_fp8_tma_decode.py tests/inference/test_fp8_producer_kernels.py \
        tests/inference/test_fp8_act_quant.py -k "tma or scaled_mm_matches or producer or \
        eager_output or token" 2>&1 | tee "$OUT/fp8_tma_tests.log" \
        | grep -E "TMA|passed|failed|Error" | tail -8
    timeout 200 python3 bench/fp8_gemm_sweep.py --shapes 8b --rows 64 --scales channel \
        --kernels weight_only tma --reps 20 --out "$OUT/sweep.json" 2>&1 \
        | grep -E '"best"|"layer"|quantize_us' | cut -c1-400
    timeout 300 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales channel \
        --decode-kernels weight_only tma --out "$OUT/fp8_decode.json" 2>&1 | grep -E '^\{' \
        | grep -o '"bf16_step_ms.*' | cut -c1-600
    ;;
  fp8tma_h100)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_rollout.py \
        tests/inference/test_fp8_tma_decode.py tests/inference/test_fp8_producer_kernels.py \
        tests/inference/test_fp8_act_quant.py 2>&1 | tee "$OUT/fp8_tests.log" \
        | grep -E "TMA|fp8 vs|everywhere|passed|failed|Error" | tail -8
    timeout 420 python3 bench/fp8_decode.py --shapes 8b --batches 64 256 --scales channel \
        --decode-kernels weight_only tma tma@256 --out "$OUT/fp8_decode.json" 2>&1 \
        | grep -E '^\{' | grep -o '"bf16_step_ms.*' | cut -c1-700
    ;;
  fp8tma_089)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_rollout.py \
        tests/inference/test_fp8_tma_decode.py tests/inference/test_fp8_producer_kernels.py \
        2>&1 | tee "$OUT/fp8_tests.log" | grep -E "TMA|fp8 vs|passed|failed|Error" | tail -8
    timeout 330 python3 bench/fp8_decode.py --shapes 0.89b --batches 64 256 --scales channel \
        --decode-kernels weight_only tma --grpo --out "$OUT/fp8_decode_089.json" \
        > "$OUT/fp8_decode_089.log" 2>&1
    python3 -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if k not in \
        ('decode_tiles', 'args')}) for l in open(sys.argv[1]) if l.startswith('{')]" \
        "$OUT/fp8_decode_089.log" | cut -c1-900
    ;;
  fp8_256)
    timeout 420 python3 bench/fp8_decode.py --shapes 0.89b 8b --batches 64 256 --scales channel \
        --decode-kernels weight_only --grpo --out "$OUT/fp8_decode.json" 2>&1 \
        | grep -E '^\{' | cut -c1-700
    ;;
  fp8graph)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fp8_rollout.py \
        -k graph_tuning 2>&1 | tee "$OUT/fp8_graph_test.log" \
        | grep -E "graph tuning|passed|failed|Error" | tail -6
    timeout 280 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales channel \
        --decode-kernels tma+nographtuning tma --rounds 4 --out "$OUT/fp8_graph.json" 2>&1 \
        | grep -E '^\{' | tee "$OUT/fp8_graph.log" | grep -o '"graph_tuning".*' | cut -c1-2500
    ;;
  fp8promote)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/inference/test_fp8_tma_decode.py \
        tests/inference/test_fp8_swiglu_gemm.py 2>&1 | tail -2
    timeout 150 python3 bench/fp8_gemm_graph_probe.py --linears gate_up --promote 128 0 \
        --candidates 8 9 10 11 12 --out "$OUT/promote_probe.json" 2>&1 | grep -E '^\{' \
        | cut -c1-400
    timeout 100 python3 bench/fp8_gemm_graph_probe.py --linears down --promote 128 0 \
        --candidates 26 27 29 --out "$OUT/promote_probe_down.json" 2>&1 | grep -E '^\{' \
        | cut -c1-400
    timeout 200 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales channel \
        --decode-kernels tma+promote128 tma+promote0 --rounds 3 --out "$OUT/fp8_promote.json" 2>&1 \
        | grep -E '^\{' | cut -c1-1500
    ;;
  fp8promote2)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    for p in 128 0; do
      PARALLEL_MODELS_FP8_PROMOTE=$p timeout 120 python3 -m pytest -q -s -p no:cacheprovider \
          tests/gpu/test_fp8_rollout.py -k engine_vs_bf16 2>&1 \
          | grep -E "fp8 vs|everywhere|relative|passed|failed" | sed "s/^/promote $p: /"
    done
    timeout 300 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales channel \
        --decode-kernels tma+promote0 tma+promote128 --rounds 4 \
        --out "$OUT/fp8_promote2.json" 2>&1 \
        | grep -E '^\{' | grep -o '"bf16_step_ms.*' | cut -c1-600
    ;;
  fp8table)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 560 python3 bench/fp8_decode.py --shapes 0.89b 8b --batches 64 256 \
        --scales channel --decode-kernels tma --grpo --rounds 3 --out "$OUT/fp8_table.json" \
        > "$OUT/fp8_table.log" 2>&1
    python3 -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if k not in \
        ('decode_tiles', 'args', 'graph_tuning')}) for l in open(sys.argv[1]) \
        if l.startswith('{')]" "$OUT/fp8_table.log" | cut -c1-900
    ;;
  fp8graph_timeline)
    timeout 170 python3 bench/decode_timeline.py \
        --decode-kernels bf16 tma > "$OUT/timeline_graph.log" 2>&1
    tail -40 "$OUT/timeline_graph.log"
    ;;
  fp8_kv)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/inference/test_split_kv_fp8.py \
        tests/inference/test_fp8_kv_cache.py tests/inference/test_split_kv_attention.py 2>&1 \
        | tee "$OUT/fp8_kv_tests.log" | tail -8
    timeout 240 python3 bench/fp8_decode.py --shapes 8b --batches 64 256 --scales block \
        --decode-kernels weight_only --kv-fp8 2>&1 | tee "$OUT/fp8_kv_decode.log" | tail -8
    ;;
  fp8_channel)
    timeout 230 python3 bench/fp8_decode.py --shapes 8b --batches 64 --scales channel \
        2>&1 | tee "$OUT/fp8_decode_channel.log" | tail -6
    ;;
  async)
    timeout 560 python3 bench/async_grpo.py --mode both --preset long-tail --steps 7 --warmup 2 \
        --weight-push group > "$OUT/async.log" 2>&1
    grep -E '^\{"mode"' "$OUT/async.log" | cut -c1-1500
    ;;
  critic)
    mkdir -p "$BG"
    setsid nohup python3 bench/grpo_scale.py --layout tp2 --critic --steps 5 --timeout 1500 \
        --device-mib 81559 --no-trainer-offload --actor optimizer_offload_fraction=1 \
        recompute=full --critic-opt lora.rank=64 recompute=full --root "$BG/root" \
        --out "$BG/ppo_tp2.json" > "$BG/run.log" 2>&1 < /dev/null &
    wait_bg 540
    ;;
  poll)
    wait_bg "${2:-560}"
    ;;
  pp2trace)
    timeout 560 python3 bench/grpo_scale.py --layout pp2 --steps 5 --timeout 530 \
        --device-mib 81559 --no-trainer-offload --actor optimizer_offload_fraction=1 \
        recompute=full --memory-trace "$OUT/trace" --out "$OUT/pp2.json" 2>&1 \
        | grep -v "it/s\]" | tail -30
    ;;
  gpu)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 240 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    timeout 300 python3 bench/moe_bench.py --out "$OUT/moe.json" 2>&1 | tail -40
    ;;
  liger)
    timeout 420 python3 bench/liger_bench.py --out "$OUT/liger.json" --profile "$OUT/liger_kernels" 2>&1 \
        | tail -80
    ;;
  replay)
    timeout 540 python3 bench/router_replay_bench.py --out "$OUT/router_replay.json" 2>&1 \
        | tee "$OUT/router_replay.log" | grep -v '^[ {}]' | tail -30
    ;;
  decode)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 90 python3 bench/decode_profile.py --variants ours no_fused_rope aten_attention \
        baseline --out "$OUT/decode_profile.json" 2>&1 | tee "$OUT/decode_profile.log" | grep -v "^[ {}]" \
        | tail -120
    timeout 75 python3 bench/decode_attention_sweep.py --budget-s 45 \
        --out "$OUT/decode_attention_sweep.json" 2>&1 | tee "$OUT/decode_attention_sweep.log" \
        | tail -12
    timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_gpu_split_kv.py \
        tests/gpu/test_gpu_fused_draw.py tests/gpu/test_gpu_continuous.py 2>&1 \
        | tee "$OUT/decode_gpu_tests.log" | tail -15
    ;;
  decode_bench)
    timeout 180 python3 bench/rollout_bench.py --cases decode --out "$OUT/rollout_decode.json" 2>&1 \
        | tee "$OUT/rollout_decode.log" | tail -6
    ;;
  exact)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_exact_mode.py \
        tests/models/test_exact_kernels.py 2>&1 | tee "$OUT/exact_gpu_tests.log" | tail -25
    timeout 240 python3 bench/exact_mode_bench.py --out "$OUT/exact_mode.json" 2>&1 \
        | tee "$OUT/exact_mode.log" | grep -v '^[ {}]' | tail -15
    ;;
  tp_pp)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    TR="timeout 75 torchrun --standalone --nproc-per-node 2"; SECONDS=0
    $TR bench/tp_bench.py --tp 1 --out "$OUT/tp1.json" > "$OUT/tp1.log" 2>&1; echo "tp1: $(grep -h '"tokens_per_s_per_gpu"' "$OUT/tp1.log")"
    T1="--tp1-json $OUT/tp1.json"
    run_tp() { name=$1; shift; $TR bench/tp_bench.py --tp 2 $T1 --out "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1; echo "$name: $(grep -h 'share of TP=1' "$OUT/$name.log")"; }
    run_tp tp2 --overlap-chunks 0
    run_tp tp2_k2 --overlap-chunks 2 --profile "$OUT/tp2_k2_kernels.txt"
    run_tp tp2_k4 --overlap-chunks 4
    run_tp tp2_k2_maxconn1 --overlap-chunks 2 --max-connections-1
    run_tp tp2_sp --sequence-parallel
    run_tp tp2_sp_k2 --sequence-parallel --overlap-chunks 2
    for split in "16 16" "17 15" "15 17"; do name=pp2_${split/ /_}
      $TR bench/pp_bench.py --microbatches 16 --layers-per-stage $split $T1 \
          --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$name: $(grep -h 'share of TP=1' "$OUT/$name.log")"; tail -2 "$OUT/$name.log"; done
    echo "tp_pp total: ${SECONDS} s"
    ;;
  wgrad)
    # weight-gradient GEMMs fused into DDP's fp32 buffers: the GPU test, then the 8B shape at
    # TP=1 on this one GPU, unfused (default) vs fused rounds alternated (+ a kernel table)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_wgrad_fusion.py 2>&1 \
        | tee "$OUT/wgrad_gpu_tests.log" | tail -8
    timeout 300 torchrun --standalone --nproc-per-node 1 bench/tp_bench.py --tp 1 \
        --compare-wgrad-fusion --profile "$OUT/tp1_ddp_kernels.txt" --out "$OUT/tp1_ddp.json" > "$OUT/tp1_ddp.log" 2>&1
    grep -hE '"(step_s|fused_wgrad_step_s|tflops_per_gpu|share_of_matmul_peak|matmul_peak_tflops|peak_gib|fused_wgrad_linears)"' \
        "$OUT/tp1_ddp.log"; tail -3 "$OUT/tp1_ddp.log"
    ;;
  elementwise)
    # SwiGLU / RMSNorm / add-RMSNorm as Triton kernels (llama/layers/elementwise_triton.py):
    # tests (the interpreter file runs on CUDA here too), the micro-bench (+ launch-config
    # sweep), then the 8B shape at TP=1: kernels (default) vs compiled, rounds alternated
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_elementwise_kernels.py \
        tests/models/test_elementwise_kernels.py 2>&1 | tee "$OUT/elementwise_tests.log" | tail -12
    timeout 150 python3 bench/elementwise_bench.py --sweep --out "$OUT/elementwise.json" \
        > /tmp/elementwise_bench.log 2>&1; grep -v '^[] {}]' /tmp/elementwise_bench.log | tail -8
    timeout 420 torchrun --standalone --nproc-per-node 1 bench/tp_bench.py --tp 1 \
        --compare-triton-elementwise --profile "$OUT/tp1_elementwise_kernels.txt" \
        --out "$OUT/tp1_elementwise.json" > /tmp/tp1_elementwise.log 2>&1
    grep -hE '"(step_s|compiled_elementwise_step_s|tflops_per_gpu|share_of_matmul_peak|matmul_peak_tflops|triton_elementwise)"' \
        /tmp/tp1_elementwise.log; tail -3 /tmp/tp1_elementwise.log
    ;;
  firstwrite)
    nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_grad_first_write.py 2>&1 \
        | tee "$OUT/first_write_gpu_test.log" | grep -E "first write|passed|failed|Error" | tail -6
    for kernel in 1 0; do  # first write with the Triton buffer kernel, then with copy_ / add_
      PARALLEL_MODELS_GRAD_BUFFER_KERNEL=$kernel timeout 200 torchrun --standalone \
          --nproc-per-node 1 bench/tp_bench.py --tp 1 --compare-grad-first-write \
          --profile "$OUT/tp1_first_write_k$kernel.txt" --out "$OUT/tp1_first_write_k$kernel.json" \
          > /tmp/tp1_first_write.log 2>&1
      echo "buffer kernel $kernel:"; grep -hE '"(step_s|zeroed_buffers_step_s|share_of_matmul_peak)"' \
          /tmp/tp1_first_write.log | head -3; done
    CUDA_VISIBLE_DEVICES= timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/distributed/test_grad_first_write.py tests/models/test_moe_aux_loss_pp.py tests/rl/test_moe_aux_loss.py \
        tests/rl/test_moe_expert_parallel_ppo.py tests/distributed/test_wgrad_fusion.py 2>&1 \
        | tee "$OUT/mcore019_new_tests.log" | tail -8
    ;;
  mcore)
    CUDA_VISIBLE_DEVICES= timeout 540 python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/models/test_moe.py tests/models/test_qwen3.py tests/rl/test_trainer_checkpoint.py tests/test_house.py \
        2>&1 | tee "$OUT/mcore019_tests.log" | tail -25
    ;;
  house)
    # the house refactor (issue 29) on the GPU host: tests/gpu, then the layout / families /
    # rollout-interface CPU tests on megatron-core 0.19 (GPU hidden: gloo on the CPU)
    nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
    timeout 300 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    CUDA_VISIBLE_DEVICES= timeout 240 python3 -m pytest -q -p no:cacheprovider \
        tests/distributed/test_parallel_layout.py tests/models/test_gemma.py \
        tests/models/test_family_registry.py tests/rl/test_rollout_interface.py tests/test_options.py \
        2>&1 | tee "$OUT/mcore019_house.log" | tail -15
    ;;
esac
