#!/usr/bin/env bash
# GPU checks written in a session that had no device time left to run them:
#   adaptive  the adaptive-speculation plain-step graphs and forced interleavings (on by default on CUDA), dense and
#             GLM-5, then the dense GPU tests for regressions;
#   tp        tensor parallelism over NCCL (needs a kind with 2+ GPUs): tests/test_gpu_tp.py;
#   gptfast   plain decode at batch 1 against gpt-fast side by side (issue 17 item 2): carry `.gpt-fast/` holding
#             gpt-fast's model.py (copied from a checkout; the folder is ignored, never committed);
#   plain     the one-graph plain step on CUDA (tests/test_gpu.py -k plain_step), the sampled lossless tests on CUDA
#             (argmax and sampled drafts), and the phase benchmark's plain step on Llama-3.1-8B shapes;
#   sample    the sort-free sampling kernels (kernels/triton_sample.py) on the GPU: their tests, the lossless sampling
#             tests on CUDA, bench_sample.py against the torch reference, then gpt-fast side by side (carry .gpt-fast);
#   gemv      the fused decode GEMVs (kernels/triton_gemv.py), the norm inside the MoE router and the in-kernel
#             split-KV merge: their GPU tests, the kernel benchmarks (bench_gemv.py, bench_router.py's norm
#             columns), and bench_pdl.py (whether programmatic dependent launch hides the gaps);
#   gemvsweep the GEMVs' config sweep (paste the printed dict into triton_gemv._TUNED and the shapes they win into
#             kernels/gemv_policy.py FASTER), then bench-phases on 8B shapes with --decode-gemv cublas and triton;
#   moe       the MoE decode fusions (router GEMV + top-k, q/k norm + RoPE + KV store) at model level: the hybrid and
#             MoE GPU tests, then bench-phases on Qwen3-30B-A3B and Qwen3-Next shapes at batch 1 and 8.
#   next      what the fifth session of 2026-12-01 left unmeasured: the sampling kernels' chunk sweep, the GEMV
#             sweep on Qwen3-30B-A3B's attention shapes, Qwen3-30B-A3B and Qwen3-Next phases now that `auto` fuses
#             their attention projections and routers, and GLM-5 with prefill graphs at 2048 tokens; first the GPU
#             tests of the one-launch sampled-draft kernels (kernels/triton_candidates.py, accept_sampling_q_triton)
#             and of the kernels' token rows; then `smollm2_round.sh keep / join / qspec` for q-drafts' speed.
#   seventh   what the sixth session of 2026-12-01 left unmeasured: the sampler's 6 levels of 5 bits and its
#             launches without memsets (bench_sample.py against §19.2's table); the sampled speculative step's
#             kernels against the greedy one's (profile_spec_step.py --sampled: where §19.3's 1.97 plain steps a
#             spec step go; `smollm2_round.sh qspec` rows now also say how many sampled steps ran as one graph);
#             the DSA top-k's chunk policy and the MLA split merge over all splits at once (their GPU tests,
#             bench_mla.py's sparse / dense / indexer rows, the per-kernel profile at batch 1 and 32k keys), then
#             GLM-5's phases at 32k (eager prefill now as token rows through the DSA kernels); the skinny GEMM for 2..16 rows (kernels/triton_gemv.py _rows_kernel: verify's
#             rows under --decode-gemv triton) against cuBLAS at 4 and 5 rows, and the 8B phases with it (if it
#             wins, gemv_policy gets a verify-rows set).
#   eighth    the GEMVs with programmatic dependent launch and the row GEMV at verify's rows (ran: BENCHMARKS §21).
#   ninth     what the first session of 2026-12-02 left unmeasured: PDL on the RMSNorm and SiLU-and-mul kernels,
#             the 8B GEMVs without PDL again (over 8 MB), the sampled accept kernels over vocabulary chunks, the
#             plain and speculative SmolLM2 steps (greedy and sampled) and gpt-fast.
#   tenth     the speculating engine's plain step without the draft (speculative/draft_lag.py): the adaptive GPU
#             tests (dense and GLM-5, the catch-up's prefill graphs), then smollm2_round.sh keep / join / qspec.
#   eleventh  the lean plain step of a speculating engine (spec_step.plain_step_device, BENCHMARKS §22.6): the
#             adaptive GPU tests, both plain steps side by side (profile_spec_step.py; bench-phases' "plain (spec)"
#             row on 8B shapes), then
#             smollm2_round.sh keep / join / qspec (is adaptive speculation now >= plain at batch 1 sampled?).
#   twelfth / twelfth-b / thirteenth  the one-token MoE path, PDL at decode sizes, the DSA top-k's launches.
#   fourteenth / fourteenth-b  the MLA kernel's launch sweep, MLA prefill absorbed vs decompressed, the GPU tests
#             of 2026-12-03 (ran: BENCHMARKS §25.2-25.3).
#   fifteenth issue 12's and 13's phase tables at batch 1/8/32/64, every phase eager against graph: NOT RUN YET
#             (no device time left on 2026-12-03); also unrun: tests/test_gpu_moe.py and the hybrid every-phase test
#             ran only on a helper's tree, the min-p GPU lossless case, all of tests/test_gpu_mla.py after §25.3.
#   sixteenth the overlap schedule (engine/overlap.py): tests/test_gpu.py -k overlap, vs_gpt_fast.py with both
#             schedules (carry .gpt-fast), the 8B decode graph in the same lease.
#   seventeenth the overlap schedule for speculative steps too: tests/test_gpu.py -k overlap, bench_overlap.py.
# `fifteenth`, `sixteenth` and `seventeenth` ran on 2026-12-03 (BENCHMARKS §26). For a fresh lease start with
# `tests/test_gpu.py -k overlap` (its speculative cases after runs of adaptive plain steps began to overlap: not yet
# run on a GPU), then issue 17's serving sweep again (the server now overlaps by default; `smollm2_round.sh`), then
# the per-kernel profiles (`profile_decode.py qwen3-30b-a3b`, `profile_kernels.py --parts dsa`: issue 14's
# sparse/dense ratio against the faster dense MLA of §25.3).
#   eighteenth..twentyfirst ran on 2026-12-03 (third session, BENCHMARKS §27); twentysecond, twentysecond-b and
#             twentythird in the fourth (§28). For a fresh lease: `twentyfourth` (the top-k's 256-bin passes, the sparse
#             MLA's options), `twentyfourth-b` (the one-launch routers: GPU tests, GLM-5 and 30B phases), then
#             `smollm2_round.sh keep` + `sweep 1024,4096` (prefills overlap in the server now).
#   thirtythird, -b, -c, -d (written 2026-12-04, fourth session, not yet run): Qwen3-8B's GEMV sweep, PDL on the
#             larger GEMVs, the attention's 128-key blocks, the one-token MoE as two GEMVs, the norm GEMVs without
#             their statistics prologue (LATE_RSTD); each A/B run from inside a tree copy (BENCHMARKS §34.5).
#             Order for a fresh lease: -d first (the largest expected gain, issue 17), then -c (issue 12), a, b.
#   thirtythird-d, -c, thirtyfourth, -b ran on 2026-12-04 (fifth session, BENCHMARKS §35; thirtythird and -b's
#             remaining parts were folded into thirtyfourth or dropped). For a fresh lease: `thirtyfifth` (carry
#             .gpt-fast: the sampler's 6-bit levels, gpt-fast's figure re-checked), `thirtyfifth-b` (the q/k prep
#             inside the attention kernel), `thirtyfifth-c` (the router with PDL), then `thirtythird-b`.
#   thirtyfifth, -b, -c and thirtythird-b ran on 2026-12-04 (sixth session, BENCHMARKS §36; PREP_IN_ATTENTION is now
#             on: -b now measures it against a copy without it). For a fresh lease: `thirtysixth` (the MoE and hybrid GPU tests with
#             the prep inside the attention kernel; a decode step as pure reads against the real one).
#   thirtysecond (written 2026-12-04, third session; ran in the fourth, BENCHMARKS §34.1): the q/k prep in the qkv GEMV's epilogue, and the
#             decode attention's key splits and blocks at batch 1 (profile_kernels.py --parts decode-attn).
#   twentyfourth, twentyfourth-b and twentyfifth ran in the fifth session (§29). For a fresh lease: `smollm2_round.sh
#             keep` + `sweep 1024,4096`, then `smollm2_round.sh qspec` (issue 17), the Qwen3-Next MoE sweep
#             (`twentythird`'s second half), `twentysixth` (fp8 index keys with q rounded to fp8, §29.5).
#   twentysixth and the Qwen3-Next MoE sweep ran in the sixth session (§30), with `smollm2_round.sh qspec` three times
#             and `bench_adaptive.py`. For a fresh lease: `smollm2_round.sh keep` + `join` + `sweep 1024,4096` and then
#             `sweep 30720` (issue 17's sweep at `c1829a5`: §30.5 had 0.96x at 1024 x 64 before the prefill-launch fix),
#             then `twentyseventh` (bench_adaptive.py at the last commit).
#   all of those, `twentyeighth` and `twentyeighth-b` ran in the first session of 2026-12-04 (§31). For a fresh lease:
#             `twentyninth` (the keys_m scores tile with float32 fp8 sums, §31.5: GPU tests and speed).
#   twentyninth's parts, `thirtieth` and `thirtyfirst`(-b, -c) ran in the second session of 2026-12-04 (§32). For a
#             fresh lease: `tests/test_triton_indexer.py` and `tests/test_gpu_mla.py` whole at the last commit
#             (fast_acc), then `bench-phases --preset glm-5 --batch-sizes 1,8,32 --indexer-cache-dtype fp8_e4m3`.
. scripts/gpu/env.sh
# A/B helpers (BENCHMARKS §34.5: `python3 -m` imports the package of the working directory, a script of scripts/gpu
# the package PYTHONPATH names; so each runs from inside, or on, the tree copy it measures)
variant() {  # variant NAME FILE SED: specserve/ copied to .v_NAME with one sed applied to FILE (must change it)
  rm -rf ".v_$1" && mkdir ".v_$1" && cp -r specserve ".v_$1/" && sed -i "$3" ".v_$1/specserve/$2"
  if cmp -s "specserve/$2" ".v_$1/specserve/$2"; then echo "variant $1: the sed changed nothing"; exit 1; fi
}
phase() {  # phase TREE PRESET BATCHES: decode (and verify) graph ms, run from inside the tree
  (cd "$1" && timeout 150 python3 -m specserve.cli bench-phases --preset "$2" --batch-sizes "$3" --iters 30 \
    --idle-steps 0 --prefill-tokens 0 2>&1 | grep -E "\| (decode|target_verify)" | sed "s|^|$1 $2 |")
}
in_tree() {  # in_tree TREE SCRIPT ARGS...: a script of scripts/gpu run on TREE's package (a script's own directory,
  # not the working directory, comes first on sys.path: PYTHONPATH names the tree)
  local t=$1 script=$2; shift 2
  (cd "$t" && PYTHONPATH=$PWD:/tmp/site python3 "$OLDPWD/scripts/gpu/$script" "$@" 2>&1 | grep -v -i warn \
    | sed "s|^|$t |")
}
case "${1:-}" in
  adaptive)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_mla.py \
      2>&1 | tee "$OUT/gpu_adaptive.log" | grep -v -i warn | tail -20
    ;;
  tp)
    timeout 560 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_tp.py 2>&1 | tee "$OUT/gpu_tp.log" \
      | grep -v -i warn | tail -20
    ;;
  gptfast)
    timeout 580 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast --output-file "$OUT/vs_gpt_fast.jsonl" 2>&1 \
      | grep -v -i warn | tail -6
    ;;
  plain)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_sampling_lossless.py \
      -k "plain_step or graphs_on_and_off or one_graph_exact_on_gpu" 2>&1 | grep -v -i warn | tail -6
    timeout 300 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1,32 --iters 30 2>&1 \
      | grep -v -i warn | tail -20
    ;;
  sample)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_sample.py tests/test_sampling_lossless.py \
      tests/test_sampling_cache.py 2>&1 | grep -v -i warn | tail -6
    timeout 150 python3 scripts/gpu/bench_sample.py --vocab 49152 128256 --rows 1 5 40 --iters 30 2>&1 \
      | grep -v -i warn | tail -20
    [ -d .gpt-fast ] && timeout 230 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast \
      --output-file "$OUT/vs_gpt_fast.jsonl" 2>&1 | grep -v -i warn | tail -3
    ;;
  gemv)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_gemv.py tests/test_triton_attention.py \
      tests/test_triton_router.py \
      2>&1 | grep -v -i warn | tail -4
    timeout 100 python3 scripts/gpu/bench_gemv.py 2>&1 | grep -v -i warn | tail -24
    timeout 60 python3 scripts/gpu/bench_pdl.py 2>&1 | grep -v -i warn | tail -4
    timeout 90 python3 scripts/gpu/bench_router.py --tokens 1 4 --iters 100 2>&1 | grep -v -i warn | tail -9
    ;;
  gemvsweep)
    timeout 200 python3 scripts/gpu/bench_gemv.py --sweep --shapes llama-3.1-8b smollm2-135m 2>&1 | grep -v -i warn \
      | tail -12
    for g in cublas triton; do
      timeout 120 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 --iters 30 \
        --idle-steps 0 --prefill-tokens 0 --decode-gemv $g 2>&1 | grep -v -i warn | grep -i "plain\|decode" | tail -4
    done
    ;;
  moe)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_hybrid.py tests/test_triton_router.py \
      tests/test_triton_moe.py tests/test_triton_qk_prep.py 2>&1 | grep -v -i warn | tail -6
    timeout 120 python3 scripts/gpu/bench_moe.py --tokens 1 2 4 8 --iters 100 2>&1 | grep -v -i warn | tail -8
    timeout 170 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8 --iters 20 \
      --idle-steps 0 2>&1 | grep -v -i warn | tail -14
    timeout 170 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,8 --prefix-len 1024 \
      --context-length 2048 --iters 20 --idle-steps 0 2>&1 | grep -v -i warn | tail -14
    ;;
  next)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_kernel_globals.py tests/test_triton_candidates.py \
      tests/test_triton_mla.py tests/test_triton_indexer.py tests/test_triton_topk.py tests/test_sampling_lossless.py \
      2>&1 | grep -v -i warn | tail -4
    timeout 150 python3 scripts/gpu/bench_sample.py --vocab 49152 151936 --rows 1 5 --iters 30 \
      --chunks 1024 2048 4096 8192 2>&1 | grep -v -i warn | tail -14
    timeout 90 python3 scripts/gpu/bench_gemv.py --sweep --shapes qwen3-30b-a3b 2>&1 | grep -v -i warn | tail -8
    timeout 140 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8 --iters 20 \
      --idle-steps 0 2>&1 | grep -v -i warn | tail -14
    timeout 120 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1 --iters 6 --idle-steps 0 \
      --prefill-tokens 2048 2>&1 | grep -v -i warn | grep -i "prefill\|decode\|spec iter"
    ;;
  seventh)  # in two calls (each under the 10-minute limit): `seventh a` (sampling, the spec step, the GEMMs), `seventh b`
    if [ "${2:-a}" = a ]; then
      timeout 150 python3 scripts/gpu/bench_sample.py --vocab 49152 128256 --rows 1 5 40 320 --iters 20 2>&1 \
        | grep -v -i warn | tail -26
      timeout 120 python3 scripts/gpu/profile_spec_step.py --sampled 4 2>&1 | grep -v -i warn | tail -75
      timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_gemv.py tests/test_gpu.py -k \
        "gemv or adaptive_plain or plain_step" 2>&1 | grep -v -i warn | tail -3
      timeout 80 python3 scripts/gpu/bench_gemv.py --rows 4 5 --shapes llama-3.1-8b smollm2-135m 2>&1 \
        | grep -v -i warn | tail -24
      for g in auto triton; do timeout 70 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 \
        --iters 20 --idle-steps 0 --prefill-tokens 0 --decode-gemv $g 2>&1 | grep -v -i warn | tail -12; done
    else
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_mla.py tests/test_triton_topk.py \
        tests/test_gpu_mla.py 2>&1 | grep -v -i warn | tail -4
      timeout 60 python3 scripts/gpu/profile_kernels.py --parts dsa 2>&1 | grep -v -i warn | tail -14
      timeout 150 python3 scripts/gpu/bench_mla.py sparse mla indexer 2>&1 | grep -v -i warn | tail -40
      timeout 150 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8 --prefix-len 32000 \
        --context-length 33000 --iters 6 --idle-steps 0 --prefill-tokens 2048 2>&1 | grep -v -i warn | tail -20
    fi
    ;;
  eighth)  # the GEMVs launched with programmatic dependent launch and the row GEMV at verify's rows (carry .gpt-fast)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_gemv.py tests/test_gpu.py -k \
      "gemv or plain_step" 2>&1 | grep -v -i warn | tail -3
    timeout 90 python3 scripts/gpu/bench_gemv.py --rows 1 5 --shapes smollm2-135m llama-3.1-8b 2>&1 \
      | grep -v -i warn | grep -i "layer\|M [15]"
    timeout 80 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 --iters 20 --idle-steps 0 \
      --prefill-tokens 0 2>&1 | grep -v -i warn | tail -10
    timeout 60 python3 scripts/gpu/profile_spec_step.py 4 2>&1 | grep -v -i warn | grep -i "wall"
    [ -d .gpt-fast ] && timeout 240 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast \
      --output-file "$OUT/vs_gpt_fast.jsonl" 2>&1 | grep -v -i warn | tail -4
    ;;
  ninth)  # what the first session of 2026-12-02 left unmeasured (carry .gpt-fast): PDL on RMSNorm and SiLU-mul too,
           # the 8B's GEMVs back without PDL, q/k prep + attention with it; then smollm2_round.sh keep / join / qspec
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_pdl.py tests/test_kernel_launch.py \
      tests/test_triton_kernels.py tests/test_triton_gemv.py tests/test_triton_attention.py \
      tests/test_triton_qk_prep.py tests/test_gpu.py -k "pdl or launch or chunk or \
      (not tp and (kernel or norm or silu or gemv or fixed or qk or plain_step or graphs_on_and_off))" 2>&1 \
      | grep -v -i warn | tail -3
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_triton_accept.py tests/test_triton_candidates.py \
      tests/test_sampling_lossless.py 2>&1 | grep -v -i warn | tail -3
    timeout 100 python3 scripts/gpu/profile_spec_step.py --sampled 4 2>&1 | grep -v -i warn \
      | grep -i "wall\|accept_kernel\|residual\|race"
    timeout 80 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 --iters 20 --idle-steps 0 \
      --prefill-tokens 0 2>&1 | grep -v -i warn | tail -10
    [ -d .gpt-fast ] && timeout 240 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast \
      --output-file "$OUT/vs_gpt_fast.jsonl" 2>&1 | grep -v -i warn | tail -4
    ;;
  tenth)  # the plain step without the draft, and its catch-up
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_mla.py \
      -k "adaptive or plain_step or spec_greedy" 2>&1 | grep -v -i warn | tail -4
    ;;
  twelfth)  # PDL for the router, MoE, indexer, top-k and MLA kernels, the MoE's direct path at one token; carry
    # .bench_prev (the previous commit's specserve/ and scripts/) for the side-by-side rows. Part a: kernels
    timeout 260 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_pdl.py tests/test_triton_moe.py \
      tests/test_triton_router.py tests/test_triton_indexer.py tests/test_triton_topk.py 2>&1 | grep -v -i warn | tail -4
    timeout 90 python3 scripts/gpu/bench_moe.py --tokens 1 2 4 8 --iters 100 2>&1 | grep -v -i warn | tail -7
    for tree in . .bench_prev; do
      echo "=== tree: $tree ==="
      (cd "$tree" && PYTHONPATH=$PWD timeout 60 python3 scripts/gpu/profile_kernels.py --parts dsa 2>&1 \
        | grep -v -i warn | grep -A 12 "===")
    done
    ;;
  twelfth-b)  # part b: model level, this tree and the previous commit's side by side; then the engines' GPU tests
    for tree in . .bench_prev; do
      echo "=== tree: $tree ==="
      (cd "$tree" && PYTHONPATH=$PWD timeout 120 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b \
        --batch-sizes 1 --iters 20 --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn \
        | grep "decode\|verify\|spec iter\|plain\|draft\|bandwidth")
    done
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_mla.py tests/test_gpu_hybrid.py \
      -k "greedy or mtp or plain_step" 2>&1 | grep -v -i warn | tail -4
    ;;
  thirteenth)  # the one-token MoE's in-kernel sum, the top-k without its count kernel, the sparse MLA's splits,
    # the catch-up in prefill-graph-sized groups (the hybrid all-phases test of §23.5)
    timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_triton_topk.py tests/test_triton_moe.py \
      tests/test_gpu_pdl.py 2>&1 | grep -v -i warn | tail -3
    timeout 50 python3 scripts/gpu/profile_kernels.py --parts dsa 2>&1 | grep -v -i warn | grep "===\|splits"
    timeout 80 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1 --iters 30 \
      --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn | grep "| decode\|plain step  \|bandwidth ="
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_hybrid.py -k "fp32_all_phases" 2>&1 \
      | grep -v -i warn | tail -2
    ;;
  eleventh)  # the lean plain step of a speculating engine, against the plain engine's
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_mla.py \
      -k "adaptive or plain_step or spec_greedy" 2>&1 | grep -v -i warn | tail -4
    timeout 150 python3 scripts/gpu/profile_spec_step.py --sampled 4 2>&1 | grep -v -i warn | grep "wall"
    timeout 100 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 --iters 20 --idle-steps 0 \
      --prefill-tokens 0 2>&1 | grep -v -i warn | grep "plain\|spec iter"
    ;;
  fourteenth)  # the MLA kernel's config sweep on GLM-5 shapes, MLA prefill absorbed against decompressed
    # (--mla-prefill), the tests written on 2026-12-03 that need a GPU: the MLA kernel, min-p in the sampled
    # one-graph step (ran at 3f7b733 with a kernel generalisation that was then dropped: BENCHMARKS §25.3)
    timeout 220 python3 scripts/gpu/bench_mla.py sweep --budget 190 2>&1 | tee "$OUT/mla_sweep.log" \
      | grep -v -i warn | tail -45
    timeout 120 python3 scripts/gpu/bench_mla_prefill.py 2>&1 | tee "$OUT/mla_prefill.log" | grep -v -i warn \
      | tail -30
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py \
      "tests/test_sampling_lossless.py::test_spec_sampling_one_graph_exact_on_gpu" 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -v -i warn | tail -6
    ;;
  fourteenth-b)  # the MLA kernel's new default head blocks: GPU kernel tests, the sweep against the new defaults,
    # the MLA / DSA model tests on the GPU
    timeout 90 python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_mla.py -k "cuda or 64_head" -rf \
      2>&1 | tee "$OUT/gpu_mla_kernel.log" | grep -v -i warn | tail -4
    timeout 80 python3 scripts/gpu/bench_mla.py sweep --budget 60 2>&1 | tee "$OUT/mla_sweep_b.log" \
      | grep -v -i warn | grep "|" | head -14
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_mla.py 2>&1 \
      | tee "$OUT/gpu_mla.log" | grep -v -i warn | tail -4
    ;;
  fifteenth)  # issue 12's and 13's phase tables at batch 1, 8, 32, 64, every phase eager against graph
    timeout 290 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8,32,64 --iters 10 \
      --idle-steps 5 --prefill-tokens 0 --output-file "$OUT/phases_moe.jsonl" 2>&1 | grep -v -i warn | tail -36
    timeout 290 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,8,32,64 \
      --prefix-len 1024 --context-length 2048 --iters 10 --idle-steps 5 --prefill-tokens 0 \
      --project-accept-lengths 3.0,3.7 --output-file "$OUT/phases_next.jsonl" 2>&1 | grep -v -i warn | tail -40
    ;;
  sixteenth)  # the overlap schedule: its GPU test, then gpt-fast side by side (carry .gpt-fast) with the 8B decode
    timeout 170 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k overlap 2>&1 | grep -v -i warn \
      | tail -6
    timeout 330 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast --output-file "$OUT/vs_gpt_fast.jsonl" 2>&1 \
      | grep -v -i warn | tail -6
    timeout 90 python3 -m specserve.cli bench-phases --preset llama-3.1-8b --batch-sizes 1 --iters 20 --idle-steps 0 \
      --prefill-tokens 0 2>&1 | grep -v -i warn | tail -14
    ;;
  eighteenth)  # the first lease of 2026-12-03's third session: the speculative overlap GPU tests (runs of adaptive
    # plain steps overlapped), then the per-kernel profiles of Qwen3-30B-A3B's decode and of DSA/MLA at 32k keys
    python3 -c "import sys; print(sys.version)"; python3 -m pip list 2>/dev/null \
      | grep -i -E "^(pydantic|aiohttp|fastapi|uvicorn|starlette|anyio|yarl|multidict|gguf) " || true
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k overlap 2>&1 | grep -v -i warn \
      | tail -8
    timeout 150 python3 scripts/gpu/profile_decode.py qwen3-30b-a3b 2>&1 | grep -v -i warn | tail -30
    timeout 150 python3 scripts/gpu/profile_kernels.py --parts dsa 2>&1 | grep -v -i warn | tail -30
    ;;
  nineteenth)  # carry .smollm2-parts/a (kept in /tmp/keep for `smollm2_round.sh sweep` next, same warm machine):
    # the sparse MLA's one-block splits and issue 14's DSA step against dense MLA at 32k, batch 1-64; issue 12's,
    # 13's and 14's phases at batch 1 (ran at a5b8720 with a flag since removed, --verify-locality: BENCHMARKS §27.3)
    mkdir -p /tmp/keep && cp .smollm2-parts/a/part00 /tmp/keep/
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py -k cuda 2>&1 | tail -2
    timeout 150 python3 scripts/gpu/profile_kernels.py --parts dsa dsa-batches 2>&1 | grep -v -i warn | tail -22
    timeout 150 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8 --iters 10 \
      --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -24
    timeout 150 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,32 \
      --prefix-len 1024 --context-length 2048 --iters 10 --idle-steps 0 --prefill-tokens 0 2>&1 \
      | grep -v -i warn | tail -24
    timeout 150 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1 --iters 10 --idle-steps 0 \
      --prefix-len 32000 --context-length 33000 --prefill-tokens 0 2>&1 | grep -v -i warn \
      | tail -14
    ;;
  twentieth)  # the absorbed-MLA kernel at 64-head launches, 32 vs 64 keys a step, and the batch-32 DSA step's kernels
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts mla-n64 2>&1 | grep -v -i warn | tail -20
    ;;
  twentyfirst)  # the indexer's multi-block programs and the MLA's 64 keys a step at 64 heads: GPU kernel tests, the
    # scores kernel's walk lengths, issue 14's DSA step vs dense MLA again, then the MLA/DSA model GPU tests
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_indexer.py tests/test_triton_topk.py \
      tests/test_triton_mla.py -k "cuda or gpu" 2>&1 | tail -2
    timeout 100 python3 scripts/gpu/profile_kernels.py --parts scores-steps dsa-batches 2>&1 | grep -v -i warn \
      | tail -14
    timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_mla.py 2>&1 | grep -v -i warn | tail -4
    ;;
  twentysecond)  # what the third session of 2026-12-03 left unmeasured: overlapped prefills on the GPU (the overlap
    # GPU tests now count them), the indexer's multi-block walks' GPU test, all of the MLA GPU tests, issue 14's ratio
    # with contiguous slots, GLM-5's phases at 32k and batch 1 / 8 (64 keys a step at 64-head MLA programs)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k overlap \
      tests/test_triton_indexer.py 2>&1 | grep -v -i warn | tail -4
    timeout 260 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_mla.py 2>&1 | grep -v -i warn | tail -4
    timeout 120 python3 scripts/gpu/profile_kernels.py --parts dsa-layouts 2>&1 | grep -v -i warn | tail -26
    ;;
  twentythird)  # the fused MoE's launch configs swept at one token (direct) and four (aligned, verify's size), on
    # Qwen3-30B-A3B's and Qwen3-Next's expert shapes
    timeout 280 python3 scripts/gpu/bench_moe.py --sweep --tokens 1 4 --iters 40 2>&1 | grep -v -i warn | tail -40
    timeout 280 python3 scripts/gpu/bench_moe.py --sweep --tokens 1 4 --iters 40 --experts 512 --inter 512 \
      --top-k 10 2>&1 | grep -v -i warn | tail -40
    ;;
  twentyfourth)  # the top-k's histogram passes over 256 bins (§28.6): their GPU tests, the DSA step against dense
    # MLA at batch 1-64, and the DSA step's kernels at batch 32
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_topk.py tests/test_triton_indexer.py \
      tests/test_triton_router.py 2>&1 | grep -v -i warn | tail -2
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts dsa-batches mla-n64 2>&1 | grep -v -i warn | tail -30
    timeout 240 python3 scripts/gpu/profile_kernels.py --parts sparse-mla 2>&1 | grep -v -i warn | tail -24
    ;;
  thirtythird|thirtythird-b|thirtythird-c|thirtythird-d)  # (written 2026-12-04, fourth session) A/B runs from
    # inside tree copies
    # (BENCHMARKS §34.5: `python3 -m` imports the package of the working directory, whatever PYTHONPATH says).
    # thirtythird: Qwen3-8B's GEMV launch sweep (paste the printed dict into triton_gemv._TUNED), then the 8B decode
    # with PDL on GEMVs up to 40 MB (8B's o) and 64 MB against the kept 8 MB (§33.4's tree-B run measured tree A),
    # then the 8B plain step greedy against sampled (T 0.8, top-k 200) kernel by kernel (profile_decode.py --steps).
    # thirtythird-b: the decode attention's 128-key blocks against 64 in the graphs (§34.4), 8B and 30B, batch 1, 8.
    # thirtythird-c: the one-token MoE as two GEMVs (then kernels/triton_moe_gemv.py, removed since: no faster):
    # its GPU tests, bench_moe at one token (direct path against the GEMVs) and its launch sweep, then 30B and
    # Qwen3-Next decode with it on against off (if it wins: ONE_TOKEN_GEMV = True, the sweep's configs in
    # triton_moe_gemv.moe_gemv_configs).
    # thirtythird-d: the fused norm GEMVs with LATE_RSTD (no statistics prologue; BENCHMARKS §34.7): its tests on the
    # GPU, gemv_lab.py --late, then decode on 8B, Qwen3-8B, SmolLM2 and 30B with it on against off (if it wins:
    # triton_gemv.LATE_RSTD = True, then tests/test_gpu.py and tests/test_decode_gemv.py on the GPU).
    # (-d ran in the fifth session, §35.1; LATE_RSTD is now a launch config key, so its sed no longer applies.)
    if [ "$1" = thirtythird ]; then
      timeout 240 python3 scripts/gpu/bench_gemv.py --shapes qwen3-8b --sweep --iters 20 2>&1 | grep -v -i warn | tail -16
      variant pdl40 kernels/triton_gemv.py 's/^PDL_MAX_BYTES = 8 << 20/PDL_MAX_BYTES = 40 << 20/'
      variant pdl64 kernels/triton_gemv.py 's/^PDL_MAX_BYTES = 8 << 20/PDL_MAX_BYTES = 64 << 20/'
      for t in . .v_pdl40 .v_pdl64 .v_pdl64 .v_pdl40 .; do phase $t llama-3.1-8b 1; done
      # where a sampled token's time goes beyond the greedy step's (vs_gpt_fast: 4.363 ms against bench-phases' 4.23)
      timeout 120 python3 scripts/gpu/profile_decode.py llama-3.1-8b --steps greedy sampled --top 12 2>&1 \
        | grep -v -i warn | tail -30
    elif [ "$1" = thirtythird-d ]; then
      timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py -k "late or norm" 2>&1 \
        | grep -v -i warn | tail -2
      (cd scripts/gpu && timeout 150 python3 gemv_lab.py --late --iters 30 2>&1 | grep -v -i warn | tail -7)
      variant late kernels/triton_gemv.py 's/^LATE_RSTD = False/LATE_RSTD = True/'
      for t in . .v_late .v_late .; do
        for p in llama-3.1-8b qwen3-8b smollm2-135m qwen3-30b-a3b; do phase $t $p 1; done
      done
    elif [ "$1" = thirtythird-c ]; then  # ran (§35.5); the two GEMVs were removed after §36 (no faster)
      echo "thirtythird-c: the one-token MoE GEMVs it measured are gone (BENCHMARKS §35.5, §36)"; exit 1
    else
      variant blk128 attention/triton_backend.py 's/meta.num_splits, layer.scaling, block_n=self.block_n)/meta.num_splits, layer.scaling, block_n=128)/'
      for t in . .v_blk128 .v_blk128 .; do phase $t llama-3.1-8b 1,8; phase $t qwen3-30b-a3b 1,8; done
    fi
    ;;
  thirtyfourth)  # (2026-12-04, fifth session) the fused MoE's launch-config test's GPU failure (its message), the
    # GEMV GPU tests with SmolLM2's LATE_RSTD launches, SmolLM2 decode with them against without, PDL on the 8B GEMVs
    # up to 40 / 64 MB against 8, then the 8B plain step greedy against sampled kernel by kernel
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_triton_moe.py -k tiles_override --tb=short 2>&1 \
      | grep -iE "error|passed|failed" | grep -v -i warn | head -12
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py tests/test_gpu_pdl.py \
      tests/test_decode_gemv.py 2>&1 | grep -v -i warn | tail -2
    variant nolate kernels/triton_gemv.py 's/, LATE_RSTD=1)/)/'
    for t in . .v_nolate .v_nolate .; do phase $t smollm2-135m 1; done
    variant pdl40 kernels/triton_gemv.py 's/^PDL_MAX_BYTES = 8 << 20/PDL_MAX_BYTES = 40 << 20/'
    variant pdl64 kernels/triton_gemv.py 's/^PDL_MAX_BYTES = 8 << 20/PDL_MAX_BYTES = 64 << 20/'
    for t in . .v_pdl40 .v_pdl64 .v_pdl64 .v_pdl40 .; do phase $t llama-3.1-8b 1; done
    timeout 120 python3 scripts/gpu/profile_decode.py llama-3.1-8b --steps greedy sampled --top 12 2>&1 \
      | grep -v -i warn | tail -30
    ;;
  thirtyfourth-b)  # PDL on GEMVs up to 40 MB (now the default) against 8 MB on Qwen3-30B-A3B's and Qwen3-8B's
    # shapes (their o / qkv fall under 40 MB too), then gpt-fast side by side on 8B's shapes
    variant pdl8 kernels/triton_gemv.py 's/^PDL_MAX_BYTES = 40 << 20/PDL_MAX_BYTES = 8 << 20/'
    for t in . .v_pdl8 .v_pdl8 .; do phase $t qwen3-30b-a3b 1; phase $t qwen3-8b 1; done
    timeout 240 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast --shapes llama-3.1-8b 2>&1 | grep -v -i warn \
      | tail -4
    ;;
  thirtyfifth)  # (written 2026-12-04, fifth session, after the lease; not yet run) the new pdl_mode GPU test; the
    # sampler's radix levels of 6 bits (5 launches) against 5 bits (6 launches, 47 us of the sampled 8B step, §35.3):
    # bench_sample and the whole sampled step from inside each tree; then gpt-fast twice more (§35.4: its own time
    # moved from 5.08 to 5.78-6.02 ms in the last lease; is the move the image's or the machine's?)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_pdl.py 2>&1 | grep -v -i warn | tail -2
    variant bits6 kernels/triton_sample.py 's/^BITS = 5 /BITS = 6 /'
    for t in . .v_bits6 .v_bits6 .; do
      in_tree $t bench_sample.py --vocab 128256 49152 --rows 1 5 40 --iters 50 | tail -12
    done
    for t in . .v_bits6 .v_bits6 .; do
      in_tree $t profile_decode.py llama-3.1-8b --steps sampled --top 4 | grep -E "wall|_level|_race|_stats"
    done
    for r in 1 2; do
      timeout 200 python3 scripts/gpu/vs_gpt_fast.py --gpt-fast .gpt-fast --shapes llama-3.1-8b \
        --output-file "$OUT/gptfast.jsonl" 2>&1 | grep -v -i warn | grep -E "ms/token" | tail -2
    done
    cat "$OUT/gptfast.jsonl"  # each round's figures
    ;;
  thirtyfifth-b)  # (2026-12-04; ran in the sixth session, BENCHMARKS §36.2) the q/k prep inside the decode / verify
    # attention kernel (attention/triton_backend.py PREP_IN_ATTENTION, on since): its kernel and backend tests on the
    # GPU, then decode (batch 1, 8) with it against a copy without it where a separate prep launch would run:
    # Qwen3-30B-A3B and Qwen3-8B (q/k norms), Llama-3.1-8B at batch 8 (its batch 1 preps in the qkv GEMV's epilogue)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_attention_prep.py tests/test_triton_attention.py \
      2>&1 | grep -v -i warn | tail -2
    variant noprep attention/triton_backend.py 's/^PREP_IN_ATTENTION = True/PREP_IN_ATTENTION = False/'
    for t in .v_noprep . . .v_noprep; do
      phase $t qwen3-30b-a3b 1,8; phase $t qwen3-8b 1; phase $t llama-3.1-8b 8
    done
    ;;
  thirtyfifth-c)  # (written 2026-12-04, fifth session, after the lease; not yet run) the fused router launched with
    # PDL (triton_router.ROUTER_PDL, off; §23.3 measured it only together with the MoE kernels'), alone and with
    # Qwen3-30B-A3B's o GEMV (2048, 4096) in PDL_SHAPES so it lets the router launch after its main loop
    echo "thirtyfifth-c ran (BENCHMARKS §36.3); ROUTER_PDL is gone (the router's launch config has a PDL key)"
    exit 1
    ;;
  thirtysixth)  # (written 2026-12-04, sixth session) the GPU tests of the families whose decode / verify now prep q/k
    # inside the attention kernel (PREP_IN_ATTENTION, §36.2: tests/test_gpu.py passed with it; these did not run);
    # then a decode step as pure reads only (step_ceiling.py: the most one launch per op can give, §36.8)
    # beside the real decode steps of the same shapes
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_moe.py tests/test_gpu_hybrid.py \
      tests/test_decode_gemv.py 2>&1 | grep -v -i warn | tail -8
    (cd scripts/gpu && timeout 150 python3 step_ceiling.py --iters 20 2>&1 | grep -v -i warn | tail -14)
    phase . qwen3-30b-a3b 1; phase . llama-3.1-8b 1
    ;;
  thirtysecond)  # the q/k prep in the qkv GEMV's epilogue (§33.7): its kernel tests and the model test on the GPU,
    # then decode at batch 1 with it (--decode-gemv triton: on these shapes auto plus the prep fusion) against auto,
    # side by side, on Llama-3.1-8B's and SmolLM2's shapes (if it wins, its qkv shapes go into FASTER_PREP)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_gemv.py tests/test_triton_qk_prep.py \
      2>&1 | grep -v -i warn | tail -2
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "epilogue or plain_step" 2>&1 \
      | grep -v -i warn | tail -3
    for preset in llama-3.1-8b smollm2-135m; do
      for g in auto triton auto triton; do
        echo "== $preset --decode-gemv $g"
        timeout 100 python3 -m specserve.cli bench-phases --preset $preset --batch-sizes 1 --iters 30 --idle-steps 0 \
          --prefill-tokens 0 --decode-gemv $g 2>&1 | grep -iE "copy bandwidth|\| decode|plain step " | head -4
      done
    done
    # the decode attention's key splits and blocks at batch 1 (6.55 us a layer on 8B, 6.61 on 30B: §33.1, §24.2)
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts decode-attn --iters 20 2>&1 | grep -v -i warn | tail -4
    ;;
  thirtyfirst)  # the fp8 indexer's GPU test (diagnostic); GLM-5 at 32k, batch 1, without and with a 32768-token
    # draft token map (--speculative-token-map): the draft step graph vs eager, spec iteration vs plain step
    timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_mla.py::test_fp8_indexer_triton_equals_reference_gpu \
      2>&1 | grep -v -i warn | grep -E "assert|passed|failed|Error" | tail -6
    for m in 0 32768; do
      timeout 220 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1 --iters 10 --idle-steps 0 \
        --prefix-len 32000 --context-length 33000 --prefill-tokens 0 --token-map-size $m 2>&1 | grep -v -i warn \
        | tee "$OUT/glm5_map$m.log" | tail -22
    done
    ;;
  thirtyfirst-c)  # the fp8 GPU test after the K >= 32 fix; the draft steps with a 32768-token map kernel by kernel
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_mla.py::test_fp8_indexer_triton_equals_reference_gpu \
      tests/test_triton_indexer.py -k "fp8" 2>&1 | grep -v -i warn | grep -E "assert|passed|failed|Error" | tail -6
    timeout 150 python3 scripts/gpu/profile_phase.py --preset qwen3-next-80b-a3b --phases draft_decode --bs 1 --top 30 \
      --token-map-size 32768 2>&1 | grep -v -i warn | tail -32
    timeout 150 python3 scripts/gpu/profile_phase.py --preset glm-5 --phases draft_decode --bs 1 --top 16 \
      --token-map-size 32768 2>&1 | grep -v -i warn | tail -18
    ;;
  thirtyfirst-b)  # Qwen3-Next (24 layers) at batch 1 and 32 without and with a 32768-token draft token map
    for m in 0 32768; do
      timeout 280 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,32 \
        --prefix-len 1024 --context-length 2048 --iters 10 --idle-steps 0 --prefill-tokens 0 --token-map-size $m \
        2>&1 | grep -v -i warn | tee "$OUT/qnext_map$m.log" | tail -26
    done
    ;;
  thirtieth)  # fp8 index keys through the DSA step (q_fp8, and the keys_m tile with float32 sums): GPU tests, the
    # scores kernel, the DSA step against dense MLA at 32k; GLM-5's graphed draft step kernel by kernel at batch 1
    timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_triton_indexer.py \
      tests/test_gpu_mla.py::test_fp8_indexer_triton_equals_reference_gpu 2>&1 | grep -v -i warn | tail -4
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts scores-keys-m dsa-batches-fp8 --iters 20 2>&1 \
      | grep -v -i warn | tail -24
    timeout 150 python3 scripts/gpu/profile_phase.py --preset glm-5 --phases draft_decode --bs 1 --top 24 2>&1 \
      | grep -v -i warn | tail -27
    ;;
  twentyninth)  # the scores tile as [keys, heads] with float32 fp8 sums (§31.5): GPU indexer tests, then its speed
    # against bf16 keys and the imprecise run of §31.5 (47.8 / 93.3 us at batch 32 / 64), then the launch sweep
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_indexer.py 2>&1 | grep -v -i warn | tail -3
    timeout 150 python3 scripts/gpu/profile_kernels.py --parts scores-keys-m --iters 20 2>&1 | grep -v -i warn | tail -12
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts scores-fp8-sweep --iters 20 2>&1 | grep -v -i warn \
      | tail -30
    ;;
  twentyeighth)  # q_fp8 rounded once a program (§31): GPU indexer tests, the scores kernel; issue 12's phases
    # against their bandwidth floors (bench/floors.py) at batch 1-64
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_indexer.py 2>&1 | grep -v -i warn | tail -2
    timeout 120 python3 scripts/gpu/profile_kernels.py --parts scores-fp8 2>&1 | grep -v -i warn | tail -12
    timeout 240 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1,8,32,64 --iters 10 \
      --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -44
    ;;
  twentyeighth-b)  # issue 13's and 14's phases against their bandwidth floors
    timeout 230 python3 -m specserve.cli bench-phases --preset qwen3-next-80b-a3b --batch-sizes 1,32 \
      --prefix-len 1024 --context-length 2048 --iters 10 --idle-steps 0 --prefill-tokens 0 2>&1 \
      | grep -v -i warn | tail -26
    timeout 300 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8 --iters 10 --idle-steps 0 \
      --prefix-len 32000 --context-length 33000 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -26
    ;;
  twentyseventh)  # adaptive speculation's modes through the scheduler (§30.3) at the last commit
    timeout 300 python3 scripts/gpu/bench_adaptive.py --batch-sizes 1,8,32 --output-file "$OUT/adaptive.jsonl" 2>&1 \
      | grep -v -i warn | tail -24
    ;;
  twentysixth)  # the indexer scores with q rounded to fp8 (q_fp8) against bf16 and converted fp8 keys (§29.5)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_triton_indexer.py 2>&1 | grep -v -i warn | tail -2
    timeout 240 python3 scripts/gpu/profile_kernels.py --parts scores-fp8 2>&1 | grep -v -i warn | tail -12
    ;;
  twentyfifth)  # 64-head MLA programs aim for one per SM (§29.1): GPU tests, DSA vs dense at batch 1-64, GLM-5 phases
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_mla.py "tests/test_gpu_mla.py::test_triton_mla_backend_equals_reference_gpu" \
      2>&1 | grep -v -i warn | tail -2
    timeout 200 python3 scripts/gpu/profile_kernels.py --parts dsa-batches mla-n64 2>&1 | grep -v -i warn | tail -30
    timeout 200 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8,32 --iters 10 --idle-steps 0 \
      --prefix-len 32000 --context-length 33000 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -34
    ;;
  twentyfourth-b)  # the one-launch routers (§28.6): DSA/MLA model GPU tests, then GLM-5's and Qwen3-30B-A3B's
    # phases against §28.5 and §27.3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_mla.py 2>&1 | grep -v -i warn | tail -2
    timeout 200 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8 --iters 10 --idle-steps 0 \
      --prefix-len 32000 --context-length 33000 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -26
    timeout 150 python3 -m specserve.cli bench-phases --preset qwen3-30b-a3b --batch-sizes 1 --iters 10 \
      --idle-steps 0 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -12
    ;;
  twentysecond-b)  # GLM-5's phases at 32k keys, batch 1 and 8, then the serving sweep (smollm2_round.sh sweep, as
    # §27.2: prefills now overlap too) in the next calls
    timeout 300 python3 -m specserve.cli bench-phases --preset glm-5 --batch-sizes 1,8 --iters 10 --idle-steps 0 \
      --prefix-len 32000 --context-length 33000 --prefill-tokens 0 2>&1 | grep -v -i warn | tail -26
    ;;
  seventeenth)  # the overlap schedule for speculative steps: GPU tests, then overlap vs synchronous side by side
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py -k overlap 2>&1 | grep -v -i warn \
      | tail -6
    timeout 360 python3 scripts/gpu/bench_overlap.py --presets smollm2-135m,llama-3.1-8b,qwen3-30b-a3b \
      --batch-sizes 1,8,32 --tokens 96 --repeats 2 --output-file "$OUT/overlap.jsonl" 2>&1 | grep -v -i warn | tail -20
    ;;
  *) echo "usage: $0 adaptive|tp|gptfast|plain|sample|gemv|gemvsweep|moe|next|seventh|eighth|ninth|tenth|eleventh|twelfth|twelfth-b|thirteenth|fourteenth|fourteenth-b|fifteenth|sixteenth|seventeenth" >&2
     exit 2 ;;
esac
