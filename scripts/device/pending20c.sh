#!/usr/bin/env bash
# Prepared in session 19 for the next session (~8 min): the score kernel's first summary copies issued
# before it waits for the kernel that writes its queries (cuda_mma.SCORE_EARLY, on steps that build no
# summary). 1) GPU tests: same pages, outputs and LSEs as without PDL (eager and graph-replayed, queries
# written by the kernel right before), engine tokens with every PDL option on equal those with none;
# 2) side by side with the defaults at 32K (twice) and 1M, both methods (a LOCKS-only change: the 32K
# crossover is 0.5% short).
# Ran in session 20 at d6cdcc2 (docs/results/gpu_session20/call1): no gain; SCORE_EARLY and the
# select_ab.py mode score_early were removed after (kept as the record of the command).
# Usage on the device (carry .device/wheels): bash scripts/device/pending20c.sh "$OUT"
set -u
out=${1:?output folder}
export PATH=/usr/local/cuda/bin:$PATH
KVLOCKS_TEST_TIMEOUT=240 bash scripts/device/gpu_tests.sh "$out" 4 tests/test_kernels.py tests/test_engine.py \
    tests/test_nvcc.py -k "programmatic or inductor_pdl or early"
bash scripts/device/ab_32k_1m.sh "$out" defaults19b score_early
