#!/usr/bin/env bash
# One device-tool call: install, then the named stages, each under its own time limit, logs under $OUT.
# Usage (on the GPU machine, repo root): scripts/gpu_session.sh tests kmtests dp4a fused check check3 sweep kmsweep mma ncu kernels kernels1 kvtests kvgraph
#   bench peers kv kvfull spec kvsweep dp4atests rows pdl graphs profile profilenopdl dp4asweep4 normtests roundtests peersab
#   ncugemv tilesab stagedab kvsplits (all of test_decode_attention.py) floor actsab kvprefill (prefill attention
#   over each KV format, a 512-token chunk after 4k/32k)
#   int8actsab halfab (the decode attention's float16 values, A/B) strip (kernels/gemv_strip.py: tests, GEMVs)
#   stripsweep (its tiles per shape) stripab (the model in strips against K-major, end to end); kernels also writes
#   kernels/tinygemm_faster.json (the shapes the model hands to tinygemm on this card) and returns it
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
# peers the device lacks (bitsandbytes, for bench kernels' NF4 column): wheels carried in .whl/ (pip download --no-deps)
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
git rev-parse --short HEAD 2>/dev/null
stage() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS
  timeout ${TO:-} "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; }
for s in "$@"; do case $s in
  tests) TO="-s INT" stage gpu_kv_tests 150 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 12 -W ignore \
           -p no:cacheprovider -rf --tb=line tests/kernels/test_kv_write.py tests/kernels/test_decode_attention.py \
           tests/kernels/test_prefill_attention.py
         TO="-s INT" stage gpu_mm_tests 150 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 14 -W ignore \
           -p no:cacheprovider -rf --tb=line tests/kernels/test_kernels.py ;;
  kmtests) TO="-s INT" stage gpu_kmajor_tests 150 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
           -p no:cacheprovider -rf --tb=short tests/kernels/test_gemv_kmajor.py tests/kernels/test_fused_kernels.py ;;
  dp4a) TO="-s INT" stage gpu_dp4a_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
          -p no:cacheprovider -rf --tb=short tests/kernels/test_gemv_dp4a.py tests/kernels/test_act_round.py
        TAIL=24 stage bench_dp4a 240 python3 scripts/bench_dp4a.py --json "$OUT/bench_dp4a.json" ;;
  dp4atests) TO="-s INT" stage gpu_dp4a_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
          -p no:cacheprovider -rf --tb=short tests/kernels/test_gemv_dp4a.py tests/kernels/test_act_round.py ;;
  rows) TAIL=20 stage sweep_dp4a_rows 150 python3 scripts/sweep_dp4a_rows.py --json "$OUT/sweep_dp4a_rows.json" ;;
  dp4asweep) TAIL=12 stage sweep_dp4a 300 python3 scripts/sweep_dp4a.py --json "$OUT/sweep_dp4a.json" \
               --table kernels/gemv_dp4a_tiles.json  # later stages of this call launch the measured tiles
             cp kernels/gemv_dp4a_tiles.json "$OUT/" ;;
  dp4asweep4) TAIL=8 stage sweep_dp4a_int4 200 python3 scripts/sweep_dp4a.py --json "$OUT/sweep_dp4a.json" \
               --formats int4-g128 --shapes qkv,o,gate_up,down --table kernels/gemv_dp4a_tiles.json  # int4 layers (the head is int8)
             cp kernels/gemv_dp4a_tiles.json "$OUT/" ;;
  spec) TAIL=12 stage gpu_speculate 200 python3 scripts/gpu_speculate.py ;;  # drafts' replies equal, rows' costs
  check) stage gpu_check 150 python3 scripts/gpu_check.py ;;
  check3) stage gpu_check_qwen3 240 python3 scripts/gpu_check.py --model qwen3-0.6b ;;  # qk_norm, heads of 128
  sweep) TAIL=80 stage sweep_gemv 500 python3 scripts/sweep_gemv.py --no-mma --json "$OUT/sweep_gemv.json" \
           --table kernels/gemv_tuned.json  # later stages of this call launch the measured configurations
         cp kernels/gemv_tuned.json "$OUT/" 2>/dev/null ;;
  mma) for m in 1 8; do  # the tensor-core GEMV (kernels/gemv_mma.py) beside the autotuned GEMV, at 1 and 8 rows
         TAIL=40 stage sweep_mma_m$m 240 python3 scripts/sweep_gemv.py --m $m --no-gemv \
           --json "$OUT/sweep_mma_m$m.json"; done ;;
  normtests) TO="-s INT" stage gpu_norm_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
           -p no:cacheprovider -rf --tb=short tests/kernels/test_fused_kernels.py tests/kernels/test_act_round.py ;;
  fused) TO="-s INT" stage gpu_fused_tests 90 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -W ignore \
           -p no:cacheprovider -rf --tb=line tests/kernels/test_fused_kernels.py ;;
  ncu) stage ncu_step 240 ncu --profile-from-start off --metrics dram__bytes_read.sum,dram__bytes_write.sum --csv \
         --log-file "$OUT/ncu.csv" python3 scripts/ncu_step_bytes.py run --json "$OUT/step.json"
       stage ncu_compare 20 python3 scripts/ncu_step_bytes.py compare "$OUT/ncu.csv" "$OUT/step.json" ;;
  tilesab) cp kernels/gemv_dp4a_tiles.json /tmp/tiles_int8.json  # the shipped table plus this card's int8 tiles
           TAIL=8 stage sweep_dp4a_int8 200 python3 scripts/sweep_dp4a.py --formats int8 --shapes qkv,o,gate_up,down \
             --json "$OUT/sweep_dp4a_int8.json" --table /tmp/tiles_int8.json
           cp /tmp/tiles_int8.json "$OUT/"
           TAIL=16 stage bench_peers_shipped_tiles 150 python3 scripts/bench_decode_peers.py
           TAIL=16 stage bench_peers_int8_tiles 150 env LOCALPD_DP4A_TILES=/tmp/tiles_int8.json \
             python3 scripts/bench_decode_peers.py ;;  # the same call's A/B of the int8 tiles end to end
  stagedab) cp kernels/gemv_dp4a_tiles.json /tmp/tiles_staged.json  # the integer GEMV's cp.async stages (STAGES)
           TAIL=10 stage sweep_dp4a_staged 240 python3 scripts/sweep_dp4a.py --tiles staged --formats int4-g128,int8 \
             --shapes qkv,o,gate_up,down --json "$OUT/sweep_dp4a_staged.json" --table /tmp/tiles_staged.json
           cp /tmp/tiles_staged.json "$OUT/"
           TAIL=6 stage bench_peers_shipped_tiles 120 python3 scripts/bench_decode_peers.py --short --repeats 5
           TAIL=6 stage bench_peers_staged_tiles 120 env LOCALPD_DP4A_TILES=/tmp/tiles_staged.json \
             python3 scripts/bench_decode_peers.py --short --repeats 5 ;;  # the same call's A/B: shipped, each shape's best
  actsab) cp kernels/gemv_dp4a_tiles.json /tmp/tiles_acts.json  # the next trip's activations loaded ahead (acts)
           TAIL=10 stage sweep_dp4a_acts 240 python3 scripts/sweep_dp4a.py --tiles acts --formats int4-g128,int8 \
             --shapes qkv,o,gate_up,down --json "$OUT/sweep_dp4a_acts.json" --table /tmp/tiles_acts.json
           cp /tmp/tiles_acts.json "$OUT/"
           i=0; for t in shipped acts shipped acts; do  # the same call's A/B, twice: shipped table, each shape's best
             i=$((i + 1)); TAIL=6 stage bench_peers_${t}_tiles_$i 120 env LOCALPD_DP4A_TILES=$([ $t = acts ] && echo /tmp/tiles_acts.json \
               || echo kernels/gemv_dp4a_tiles.json) python3 scripts/bench_decode_peers.py --short --repeats 5; done ;;
  int8actsab) python3 -c "import json, torch; from localpd.kernels import gemv_dp4a as dp
t = json.load(open('kernels/gemv_dp4a_tiles.json')); card = t.setdefault(torch.cuda.get_device_name(), {})
for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
    card[f'8:{n}:{k}'] = {**dp.DEFAULT_TILE, 'acts': 1}  # int8: the tile as set, activations a trip ahead
json.dump(t, open('/tmp/tiles_int8acts.json', 'w'), indent=1)"
           i=0; for t in shipped acts shipped acts; do  # int8 with acts alone (its swept tiles read slower end to end)
             i=$((i + 1)); TAIL=6 stage bench_peers_int8_${t}_$i 120 env LOCALPD_DP4A_TILES=$([ $t = acts ] \
               && echo /tmp/tiles_int8acts.json || echo kernels/gemv_dp4a_tiles.json) python3 scripts/bench_decode_peers.py \
               --short --repeats 5; done ;;
  ncugemv) TAIL=200 stage ncu_gemv 200 ncu --profile-from-start off --section SpeedOfLight --section Occupancy \
             --section LaunchStats --section WarpStateStats python3 scripts/ncu_gemv.py --formats int4-g128,int8 ;;
  kernels) stage bench_kernels 200 localpd bench kernels --json "$OUT/bench_kernels.json" \
             --tinygemm-table kernels/tinygemm_faster.json  # where tinygemm ran faster (kernels/tinygemm.py)
           cp kernels/tinygemm_faster.json "$OUT/" ;;
  kmsweep) TAIL=14 stage sweep_kmajor 300 python3 scripts/sweep_kmajor.py --json "$OUT/sweep_kmajor.json" ;;
  kernels1) TAIL=12 stage bench_kernels_m1 200 localpd bench kernels --m 1,4 \
              --formats "int4-g128 K-major,int8 K-major,int4-g128 strips,int8 strips" --json "$OUT/bench_kernels_m1.json" ;;
  bench) TAIL=12 stage bench_e2e 300 localpd bench --synthetic llama3-8b --quant int4-g128 --prompt-len 128 \
           --gen-len 64 --batch 1,4,16 --json "$OUT/bench_e2e.json" --plot "$OUT/roofline.png" ;;
  peers) TAIL=12 stage bench_peers 150 python3 scripts/bench_decode_peers.py ;;
  profile) TAIL=40 stage profile_decode 150 python3 scripts/profile_decode_step.py ;;  # a token's kernels one by one
  profilenopdl) TAIL=40 stage profile_decode_nopdl 150 env LOCALPD_PDL=0 python3 scripts/profile_decode_step.py ;;
  peersab) TAIL=14 stage bench_peers_ab 150 python3 scripts/bench_decode_peers.py --o-apart ;;  # o's rounding A/B
  pdl) TAIL=11 stage bench_peers_pdl_off 150 env LOCALPD_PDL=0 python3 scripts/bench_decode_peers.py ;;  # kernels/pdl.py
  graphs) stage gpu_check_graphs 120 python3 scripts/gpu_check.py --graphs-only ;;
  kv) stage bench_kv 50 python3 scripts/bench_kv.py --model llama3-8b --attention-only --batch 1 ;;
  kvgraph) TAIL=8 stage bench_kv_graph 90 python3 scripts/bench_kv.py --model llama3-8b --attention-only --batch 1 \
             --contexts 4096,32768 --table-tokens 131072 ;;
  kvprefill) TAIL=8 stage bench_kv_prefill 120 python3 scripts/bench_kv.py --model llama3-8b --attention-only \
               --batch 1 --contexts 4096,32768 --prefill-chunk 512 ;;  # a chunk after a cached prefix, per KV format
  halfab) for h in 1 0 1 0; do  # int8/int4 values in float16 (HALF_VALUES) against the dots' type, alternating
            TAIL=10 stage bench_kv_graph_half$h 90 env LOCALPD_HALF_VALUES=$h python3 scripts/bench_kv.py \
              --model llama3-8b --attention-only --batch 1 --contexts 4096,32768 --table-tokens 131072; done ;;
  floor) TAIL=12 stage gpu_floor 120 python3 scripts/gpu_floor.py --json "$OUT/gpu_floor.json" ;;  # a launch's cost
  kvsweep) TAIL=10 stage sweep_decode_attention 150 python3 scripts/sweep_decode_attention.py ;;
  kvtests) TO="-s INT" stage gpu_kv_split_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 12 -W ignore \
             -p no:cacheprovider -rf --tb=short tests/kernels/test_decode_attention.py \
             tests/kernels/test_prefill_attention.py -k "long_contexts or splits or window or half" ;;
  kvsplits) TO="-s INT" stage gpu_decode_attention_tests 180 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 12 \
             -W ignore -p no:cacheprovider -rf --tb=short tests/kernels/test_decode_attention.py ;;  # every decode test
  roundtests) TO="-s INT" stage gpu_round_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
             -p no:cacheprovider -rf --tb=short tests/kernels/test_decode_attention.py -k "reduce_rounds or long_contexts" ;;
  kvfull) TAIL=30 stage bench_kv_full 400 python3 scripts/bench_kv.py --model synthetic:llama3-8b --contexts 4096 --streams 2 ;;
  strip) TO="-s INT" stage gpu_strip_tests 120 env LOCALPD_TEST_DEVICE=cuda python3 -m pytest -q -n 8 -W ignore \
           -p no:cacheprovider -rf --tb=short tests/kernels/test_gemv_strip.py tests/quant/test_tinygemm.py  # the GEMV over
           # strips, its layout; tinygemm's layout (quant/tinygemm.py) on the CUDA kernel
         stage gpu_check_strips 150 env LOCALPD_GEMV=strip python3 scripts/gpu_check.py  # the model in strips
         TAIL=24 stage bench_strip 200 python3 scripts/bench_strip.py --json "$OUT/bench_strip.json" ;;  # against dp4a
  stripsweep) TAIL=12 stage sweep_strip 240 python3 scripts/bench_strip.py --tiles --table kernels/gemv_strip_tiles.json
              cp kernels/gemv_strip_tiles.json "$OUT/" ;;  # later stages of this call launch the measured tiles
  stripab) i=0; for g in kmajor strip kmajor strip; do  # end to end in the same call, twice: the model's layout
             i=$((i + 1)); TAIL=6 stage bench_peers_${g}_$i 110 env LOCALPD_GEMV=$g python3 scripts/bench_decode_peers.py \
               --short --repeats 3; done ;;
  *) echo "unknown stage $s" ;;
esac; done
