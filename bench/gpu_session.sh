#!/usr/bin/env bash
# The GPU measurements of docs/perf.md, in parts that each fit one 10-minute device call.
# Usage (repository root, on the GPU machine): bash bench/gpu_session.sh PART
#   tests   pytest tests/gpu (the TP test runs where there are two GPUs): 400-430 s on one H200 (2026-12-04), so a call
#           of its own. Carry build/cutlass and build/mlp_pair, built here (python -c "from mxc.kernels import
#           cutlass_fp8 as c, mlp_pair_fp8 as m; c.build_library('build/cutlass/cutlass_fp8.so');
#           m.library('build/mlp_pair/mlp_pair_fp8.so')"): without the CUTLASS library its 35 tests skip (the GPU
#           image has no nvidia-cutlass to generate it), and fp8 builds there take torch._scaled_mm for prefill
#   suite   the rest of the suite (all but tests/gpu) on the GPU: its kernel tests launch compiled kernels with the
#           GPU's Triton instead of the interpreter; the `interpreter` tests skip (~250 s with 12 workers, 2026-12-04)
#   kattn   the attention kernels' tests on the GPU (tests/kernels/test_attention.py: its fp32 cases catch tf32
#           dots, which the interpreter does not)
#   decode  bf16 + fp8 decode/prefill, the PDL A/B per batch, per-kernel profiles at batch 1 and 8 and of
#           the bf16 and fp8 prefills,
#           HF compiled at batch 1, 8, 32
#   moe     Qwen3-30B-A3B shape: batch 1 vs floor, batch 64 vs HF eager, fused vs per-expert loop
#   moelab  the Qwen3-30B-A3B batch-1 kernels one by one (pair-MoE configs, the fused norm + router,
#           attention-side GEMVs; MOELAB_ARGS="--skip moe,gemv" for the router alone; MOELAB_ARGS="--skip
#           moe,gemv,scales --tokens 1,8,16,24,32" for the fused router against the three kernels at batched
#           decode: where candidates.NORM_ROUTE_MAX_TOKENS belongs)
#   moeprefill the sorted fused MoE's prefill tiles (bench/moe_prefill_lab.py): config_for's choice against the
#           heuristic before the sixty-fifth run's sweep, Qwen3-30B-A3B and Mixtral-8x7B experts, bf16 and fp8
#           (MOEPREFILL_ARGS="--tokens 2048" for the whole sweep at one size; ~1 minute a shape and format)
#   moedecode the sorted fused MoE's decode-sized tiles (bench/moe_prefill_lab.py --decode: up to 16 rows an expert):
#           config_for's choice against the heuristic, both shapes, fp8 experts (MOEDECODE_ARGS="--weights bf16,channel
#           --tokens 8,32,128,256 --shapes qwen3-30b-a3b" for the whole sweep; GB/s against bench/decode.py's copy rate)
#   moedecodestep the fp8 Qwen3-30B-A3B step at MOESTEP_BATCH (default 8,32,1) tokens in one artifact
#           (bench/decode_ab.py, 5 rounds; ~6 minutes, the 31 GB build included): as shipped against MOESTEP_VARIANTS
#           (bench/decode_ab.py's --variant syntax; default: the wgmma GEMVs split over K as before the seventieth
#           run, triton_fp8_gemv.SWAP_AB_ONE_SLICE off)
#   oneslice the wgmma fp8 GEMVs the rule splits over K in one slice at 5 stages (triton_fp8_gemv.SWAP_AB_ONE_SLICE,
#           the default since the seventieth run) against the split, in the step: Qwen3-30B-A3B at batch 1, 8 and
#           32, then Llama-3-8B at 8 and 32 (at one row its qkv was one slice already), ONESLICE_ROUNDS (default 5)
#           rounds each (~9 minutes; at 3 rounds 260 s on an H100, 2026-12-06)
#   accum   how the fp8 GEMVs and GEMM accumulate (bench/fp8_accum_lab.py): as shipped (fast, in the tensor cores)
#           against sums promoted to fp32 once a dot and after every wgmma (ACCUM_PROMOTE, default "0 1024 32"; 1024:
#           once a dot); each linear's error against exact products and its time, then tiny float32 logits cuda vs
#           CPU (~150 s a setting on an H100, 2026-12-06)
#   tp      the push all-reduce and TP GPU tests, then tp=2 (push, with and without the GEMV pushing its rows;
#           TP_MODES) vs tp=1 decode and the all-reduce times
#   ab      after decode, same call: fp8 without fuse_norm_linear
#   small   the small decode kernels (norms, RoPE, attention, SiLU) over their warps and splits
#   lab     bf16 and fp8 GEMVs one by one (fp8: SWAP_AB against the widening kernel);
#           add --all for the prefill GEMMs too
#   ablate  what each kernel costs the batch-1 step (bench/ablate.py): fp8 Llama-3-8B small kernels and GEMVs,
#           bf16, then Qwen3-30B-A3B (the router's outputs fixed)
#   pair    the persistent fp8 MLP pair (mxc.kernels.mlp_pair_fp8): its GPU tests, then against the kernel chain
#           it replaces over 32 layers at batch 1 and 8, with PDL and without (bench/mlp_pair_lab.py); carry the
#           library built here (python -c "from mxc.kernels import mlp_pair_fp8 as m; m.library('build/mlp_pair/mlp_pair_fp8.so')"):
#           this script then sets MXC_MLP_PAIR_LIBRARY to it (the GPU machine may have no nvcc); lab variants
#           built into build/mlp_pair/lab (bench/mlp_pair_lab.py --compile-variants) are timed too when carried
#   pairab  Llama-3-8B fp8 built with --mlp-pair: batch-1 decode with the pair against the chain in one artifact
#           (bench/decode_ab.py, cuda_ops.MLP_PAIR), and bf16 for the ratio
#   gaps    where the fp8 prefill's time between kernels goes (bench/prefill_gaps.py: eager against a CUDA graph
#           replay, the idle time by kernel pair) and the power check (the GEMM rate and the prefill, burst and
#           sustained)
#   fp8moe  fp8 MoE builds: their GPU tests, then Qwen3-30B-A3B fp8 batch-1 decode against bf16 (bench/decode_ab.py)
#   gemvs   each GEMV's cost in the full step and in the GEMVs-only step (bench/ablate.py; bf16 and fp8)
#   preload the one-token fp8 wgmma GEMV with its weight stages loaded into shared memory before the PDL wait
#           (bench/gemv_preload_lab.py, Gluon): correctness, then 32 layers of quantize + GEMV against the shipped GEMV
#   fold    the MoE router folded away (bench/router_fold_lab.py): the gate/up pair kernel routing from 128 unscaled
#           logits itself against the shipped router + pair kernels, 32 layers in a PDL graph, and the o GEMV's
#           extra 128 rows; kill criterion 2 us a layer
#   moefused the batch-1 MoE experts as one kernel (gate/up and down, fp32 atomics) against the shipped two
#           (bench/moe_fused_lab.py): correctness, then 32 layers of router + experts + norm in a PDL graph
#   moedownsmem the batch-1 MoE down kernel as H/BN programs, each holding its rows of the k experts' down
#           slices in shared memory, TMA-loaded before the PDL wait (bench/moe_down_smem_lab.py, Gluon): correctness,
#           then 32 layers of router + experts + norm in a PDL graph against the shipped kernels, the SM carveout by
#           default and at the most shared memory
#   moestep the bf16 MoE experts' pair kernels at half the columns a step (the fp8 experts' weight bytes), unrolled:
#           a Qwen3-30B-A3B bf16 step A/B (bench/decode_ab.py)
#   tiles   the one-token fp8 wgmma GEMV over tile-major weights (each stage's tile one contiguous piece) against the
#           row-major ones, Llama-3-8B shapes one at a time (bench/tile_layout_lab.py)
#   resident what bytes already in L2 buy the shipped fp8 gate/up and down GEMVs (bench/prefetch_lab.py --resident:
#           prefetched a line or a sector at a time, or read by loads, against another copy's bytes)
#   prefill the fp8 prefill's pieces: attention in both grid orders, the CUTLASS GEMMs against _scaled_mm per shape,
#           the quantize kernels' configs, then a 7-round prefill A/B of PREFILL_VARIANTS ("--variant a=... --variant
#           b=", bench/decode_ab.py syntax) with per-kernel profiles; prefill figures move 1-2 ms between rounds
#   sanitize compute-sanitizer memcheck over the kernel tests (SANITIZE_TESTS; default tests/kernels) with PyTorch's
#           caching allocator off, after a positive control (bench/sanitizer_control.py) it must catch; carry
#           build/sanitizer (pip download nvidia-cuda-sanitizer-api --no-deps -d build/sanitizer) if the machine has none;
#           one process: with a cold Triton cache about 500 cases in 270 s (2026-12-04), so the default
#           SANITIZE_LIMIT=500 does not reach every file of tests/kernels; run after `suite` in the same warm machine
#           (its compiled kernels cached), all of tests/kernels took 84 s (1161 passed, 63 skipped; 2026-12-05)
# Logs go to $OUT (the device tool's output folder) when set, else to build/gpu-logs.
# Device-time plan for one session (each line one call, under 10 minutes):
#   nvidia-h200:    tests, then lab  |  decode, then ab  |  moe (MOE_ARGS=--batch1-only: ~4 minutes)
#   nvidia-h200-x2: tp
set -u
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# libraries built on the CPU machine and carried (the GPU machine may have no nvcc)
if [ -f build/mlp_pair/mlp_pair_fp8.so ] && [ -z "${MXC_MLP_PAIR_LIBRARY:-}" ]; then
  export MXC_MLP_PAIR_LIBRARY="$PWD/build/mlp_pair/mlp_pair_fp8.so"
fi
if [ -f build/cutlass/cutlass_fp8.so ] && [ -z "${MXC_CUTLASS_LIBRARY:-}" ]; then  # fp8 builds' CUTLASS GEMM
  export MXC_CUTLASS_LIBRARY="$PWD/build/cutlass/cutlass_fp8.so" MXC_CUTLASS_SO="${MXC_CUTLASS_SO:-$PWD/build/cutlass/cutlass_fp8.so}"
fi
logs="${OUT:-build/gpu-logs}"
mkdir -p "$logs"
# large artifacts go to memory-backed storage where it is big enough (the MoE one is 61 GB)
scratch=/tmp
if [ -d /dev/shm ] && [ "$(df -B1G --output=avail /dev/shm | tail -1)" -gt 80 ]; then scratch=/dev/shm; fi

sanitizer_path() {  # compute-sanitizer: on the PATH, else installed from the wheel carried in build/sanitizer
  # (pip download nvidia-cuda-sanitizer-api --no-deps -d build/sanitizer, on the CPU machine)
  if command -v compute-sanitizer >/dev/null; then command -v compute-sanitizer; return; fi
  local whl=${SANITIZER_WHEEL:-}  # default: the CUDA 13 one (nvidia_cuda_sanitizer_api-13...)
  [ -n "$whl" ] || whl=$(ls build/sanitizer/nvidia_cuda_sanitizer_api-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] || { echo "no compute-sanitizer and no wheel in build/sanitizer" >&2; return 1; }
  rm -rf "$scratch/sanitizer"; python3 -m pip install -q --no-deps --target "$scratch/sanitizer" "$whl" >&2 || return 1
  find "$scratch/sanitizer" -path '*compute-sanitizer/compute-sanitizer' -type f | head -1
}

run() {  # run LIMIT_S LOG CMD...: stop at the limit with every Python thread's stack (SIGABRT)
  local limit=$1 log=$2; shift 2
  echo "== $* (limit ${limit}s)"
  timeout -s ABRT "$limit" "$@" 2>&1 | tee "$logs/$log"
}

case "${1:-}" in
  tests)  # GPU_TESTS: the test paths and pytest options (default tests/gpu), TESTS_LIMIT: seconds (default 560)
          run "${TESTS_LIMIT:-560}" pytest.log python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} --durations=10 ;;
  suite)  run 560 pytest_suite.log python3 -m pytest -q -p no:cacheprovider -n "${SUITE_WORKERS:-12}" tests --ignore=tests/gpu ;;
  accum)  for p in ${ACCUM_PROMOTE:-0 1024 32}; do
            run 170 "accum_$p.log" python3 bench/fp8_accum_lab.py --promote "$p"; done ;;
  kattn)  run 300 pytest_attention.log python3 -m pytest -q -p no:cacheprovider tests/kernels/test_attention.py ;;
  decode) run 570 decode.log python3 bench/decode.py --profile 1,8 --profile-prefill --quant fp8 --hf-batches 1,8,32 --pdl-ab \
            --out "$scratch/b8" ;;
  moe)    # the 61 GB artifact is deleted after: left in /dev/shm it slowed the next part's runs
          run "${MOE_LIMIT:-560}" moe.log python3 bench/moe.py ${MOE_ARGS:---hf} --out "$scratch/moe"; rm -rf "$scratch"/moe* ;;
  moelab) run 200 moe_lab.log python3 bench/moe_lab.py ${MOELAB_ARGS:-} ;;
  moeprefill) run 400 moe_prefill_lab.log python3 bench/moe_prefill_lab.py \
            ${MOEPREFILL_ARGS:---against-previous --tokens 512,2048,8192 --weights bf16,channel,block128} ;;
  moedecode) run 300 moe_decode_lab.log python3 bench/moe_prefill_lab.py --decode \
            ${MOEDECODE_ARGS:---against-previous --tokens 8,32,64 --weights channel,block128} ;;
  moedecodestep) run 560 moe_decode_step.log python3 bench/decode_ab.py --config bench/qwen3_30b_a3b.json --quant fp8 \
            --batch "${MOESTEP_BATCH:-8,32,1}" --rounds 5 --out "$scratch/abmd" --variant shipped= \
            ${MOESTEP_VARIANTS:---variant split=mxc.kernels.triton_fp8_gemv.SWAP_AB_ONE_SLICE=False} \
            ; rm -rf "$scratch"/abmd* ;;
  oneslice) run 300 oneslice_qwen3.log python3 bench/decode_ab.py --config bench/qwen3_30b_a3b.json --quant fp8 \
            --batch 1,8,32 --rounds "${ONESLICE_ROUNDS:-5}" --out "$scratch/abos" --variant shipped= \
            --variant split=mxc.kernels.triton_fp8_gemv.SWAP_AB_ONE_SLICE=False; rm -rf "$scratch"/abos*
          run 250 oneslice_llama.log python3 bench/decode_ab.py --quant fp8 --batch 8,32 \
            --rounds "${ONESLICE_ROUNDS:-5}" --out "$scratch/abol" --variant shipped= \
            --variant split=mxc.kernels.triton_fp8_gemv.SWAP_AB_ONE_SLICE=False; rm -rf "$scratch"/abol* ;;
  tp)     run 60 push_test.log python3 -m pytest -q -p no:cacheprovider tests/gpu/test_push_allreduce_gpu.py
          run 120 tp_test.log python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_gpu.py -k "${TP_TESTS:-one_shot or push}"
          run 400 tp.log python3 bench/decode_tp.py --tp 2 --modes "${TP_MODES:-push,push-unfused}" --out "$scratch/btp"; rm -rf "$scratch"/btp* ;;
  ab)     # after `decode` in the same call (its bf16 artifact): fp8 without fuse_norm_linear
          run 150 ab_fp8_nofold.log python3 bench/decode.py --reuse --out "$scratch/b8" --batches "" --quant fp8 \
            --disable-pass fuse_norm_linear --hf-batches "" ;;
  small)  run 280 small_lab.log python3 bench/small_lab.py ;;
  preload) run 200 preload_lab.log python3 bench/gemv_preload_lab.py ;;
  fold)   run 200 router_fold_lab.log python3 bench/router_fold_lab.py ${FOLD_ARGS:-} ;;
  moefused) run 300 moe_fused_lab.log python3 bench/moe_fused_lab.py ${MOEFUSED_ARGS:-} ;;
  moedownsmem) run 300 moe_down_smem_lab.log python3 bench/moe_down_smem_lab.py ${MOEDOWNSMEM_ARGS:-} ;;
  resident) run 200 resident_lab.log python3 bench/prefetch_lab.py --resident --shapes gate_up,down \
              --resident-delay-us 20 --regions 0:4096:4096,512:1024:16384,0:512:28672 ;;
  gemvs)  # each GEMV's cost in the full step and in the GEMVs-only step (g_*), bf16 then fp8 (GEMVS_BF16=0: fp8 only)
          gemv_skips() {  # gemv_skips KERNEL: the --skip list for the four layer GEMVs run by KERNEL, and the LM head
            local k=$1 g=ALL_BUT_GEMV name_sel name sel
            echo "--skip small=$g --skip lmhead=_gemv_kernel:N=128256 --skip g_lmhead=$g+_gemv_kernel:N=128256"
            for name_sel in qkv=N=6144 o=N=4096:K=4096 gate_up=N=28672 down=K=14336; do
              name=${name_sel%%=*} sel=${name_sel#*=}
              echo "--skip $name=$k:$sel --skip g_$name=$g+$k:$sel"
            done
          }
          [ "${GEMVS_BF16:-1}" = 1 ] && run 330 ablate_bf16_gemvs.log python3 bench/ablate.py --out "$scratch/a16" \
            --rounds 2 $(gemv_skips _gemv_kernel); rm -rf "$scratch"/a16
          run 300 ablate_fp8_gemvs.log python3 bench/ablate.py --quant fp8 --out "$scratch/a8" --rounds 2 \
            $(gemv_skips _qgemv_kernel); rm -rf "$scratch"/a8 ;;
  ablate) run 200 ablate_fp8.log python3 bench/ablate.py --quant fp8 --out "$scratch/abl8" --replay \
            --skip quant=_quant_tile_kernel --skip silu=silu_mul_kernel --skip attn=decode_split_kernel+decode_reduce_kernel \
            --skip small=ALL_BUT_GEMV --skip qkv=_qgemv_kernel:N=6144 --skip o=_qgemv_kernel:N=4096:K=4096 \
            --skip gate_up=_qgemv_kernel:N=28672 --skip down=_qgemv_kernel:K=14336; rm -rf "$scratch"/abl8
          run 120 ablate_bf16.log python3 bench/ablate.py --out "$scratch/abl16" --rounds 2 --skip small=ALL_BUT_GEMV \
            --skip gemv=ONLY_GEMV; rm -rf "$scratch"/abl16
          run 280 ablate_moe.log python3 bench/ablate.py --config bench/qwen3_30b_a3b.json --max-seq-len 512 \
            --out "$scratch/ablmoe" --skip attn=decode_split_kernel+decode_reduce_kernel --skip router=norm_route_kernel \
            --skip small=rms_norm_kernel+rope_qkv_write_kernel+decode_split_kernel+decode_reduce_kernel+norm_route_kernel \
            --skip up=_pair_up_kernel --skip down=_pair_down_tile_kernel; rm -rf "$scratch"/ablmoe ;;
  pair)   run 150 pair_test.log python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_mlp_pair_fp8_gpu.py -x
          variants=""; [ -d build/mlp_pair/lab ] && variants="--pair-lib build/mlp_pair/lab"
          run 150 pair_lab_m1.log python3 bench/mlp_pair_lab.py --m 1 $variants
          run 150 pair_lab_m8.log python3 bench/mlp_pair_lab.py --m 8 $variants
          run 100 pair_lab_m1_plain.log python3 bench/mlp_pair_lab.py --m 1 --no-pdl ;;
  pairab) run 560 pair_ab.log python3 bench/decode_ab.py --quant fp8 --mlp-pair --bf16 --out "$scratch/abp" \
            --variant chain=mxc.kernels.cuda_ops.MLP_PAIR=False --variant pair=; rm -rf "$scratch"/abp* ;;
  lab)    if [ "${2:-}" = "--all" ]; then skip=""; else skip="--skip prefill"; fi
          run 280 lab.log python3 bench/linear_lab.py --m 1,8,32 $skip ;;
  gaps)   run 300 prefill_gaps.log python3 bench/prefill_gaps.py --out "$scratch/pg" --power; rm -rf "$scratch"/pg ;;
  prefill) # the fp8 prefill's pieces (MXC_CUTLASS_LIBRARY set), then a prefill A/B of PREFILL_VARIANTS in one artifact
          run 120 attention_lab.log python3 bench/attention_lab.py --tokens 2048,4096 --orders
          run 90 prefill_lab.log python3 bench/prefill_lab.py
          run 120 quant_lab.log python3 bench/linear_lab.py --quant-lab --quant-m 2048
          run 240 prefill_ab.log python3 bench/decode_ab.py --quant fp8 --prefill 2048 --rounds 7 --profile-prefill \
            --out "$scratch/abpre" ${PREFILL_VARIANTS:---variant default=}; rm -rf "$scratch"/abpre* ;;
  fp8moe) # fp8 MoE builds (routers kept in bf16, the fused norm + router at decode): their GPU tests, then the
          # Qwen3-30B-A3B fp8 batch-1 step against bf16 in one call (the fp8 artifact is ~31 GB)
          run 200 fp8moe_test.log python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_gpu.py -k moe
          run 380 fp8moe_ab.log python3 bench/decode_ab.py --config bench/qwen3_30b_a3b.json --quant fp8 --bf16 \
            --out "$scratch/abmoe8" --variant default= --timeline default; rm -rf "$scratch"/abmoe8* ;;
  moestep) # the bf16 experts' pair kernels at the fp8 experts' weight bytes a step (half the columns), unrolled, in
          # the Qwen3-30B-A3B bf16 step (bench/decode_ab.py; variants through triton_moe_decode.OVERRIDES)
          o=mxc.kernels.triton_moe_decode.OVERRIDES
          run 560 moestep_ab.log python3 bench/decode_ab.py --config bench/qwen3_30b_a3b.json --rounds 5 \
            --out "$scratch/abmoestep" --variant base= \
            --variant d64u="$o={(2048,768,'down'):{'BLOCK_K':64,'UNROLL':True}}" \
            --variant u128="$o={(2048,768,'up'):{'BLOCK_K':128}}" \
            --variant both="$o={(2048,768,'up'):{'BLOCK_K':128},(2048,768,'down'):{'BLOCK_K':64,'UNROLL':True}}"
          rm -rf "$scratch"/abmoestep* ;;
  tiles)  run 200 tile_layout_lab.log python3 bench/tile_layout_lab.py ;;
  sanitize) # compute-sanitizer memcheck over kernel tests (SANITIZE_TESTS, default tests/kernels) with the caching
          # allocator off, so a read past a tensor leaves every allocation; first a positive control that must be caught
          san=$(sanitizer_path) || exit 1
          memcheck() {  # memcheck LOG_PREFIX: the command line that runs the rest under memcheck, each process's
            # report in $logs/LOG_PREFIX.PID.log (a command line, not a function, so that `run` can time it out)
            echo env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool memcheck --target-processes all \
              --require-cuda-init no --print-limit 20 --log-file "$logs/$1.%p.log"
          }
          errors() {  # the reports in the logs: every unindented line but the banner, the summary and the exit status
            cat "$logs"/"$1".*.log 2>/dev/null | grep '^========= [^ ]' \
              | grep -vc 'COMPUTE-SANITIZER\|ERROR SUMMARY\|Target application returned' ; }
          $(memcheck control_oob) python3 bench/sanitizer_control.py
          $(memcheck control_ok) python3 bench/sanitizer_control.py --in-bounds
          echo "control: out of bounds $(errors control_oob) reports (must be > 0), in bounds $(errors control_ok) (must be 0)"
          if [ "$(errors control_oob)" = 0 ] || [ "$(errors control_ok)" != 0 ]; then
            echo "control failed: a clean report below would prove nothing" >&2; exit 1; fi
          # one process: under memcheck, xdist's workers did not come up in 500 s (2026-12-04)
          run "${SANITIZE_LIMIT:-500}" sanitize.log $(memcheck kernels) python3 -m pytest -v --tb=line -p no:cacheprovider \
            -p no:xdist ${SANITIZE_TESTS:-tests/kernels}
          echo "memcheck reports in the tests: $(errors kernels)"
          cat "$logs"/kernels.*.log | grep -v "Host Frame" | head -200 ;;
  *) echo "usage: bash bench/gpu_session.sh tests|suite|kattn|decode|ab|moe|moelab|moeprefill|moedecode|moedecodestep|oneslice|tp|small|lab|ablate|pair|pairab|gaps|prefill|fp8moe|preload|fold|moefused|moedownsmem|gemvs|resident|moestep|tiles|sanitize|accum" >&2
     exit 2 ;;
esac
