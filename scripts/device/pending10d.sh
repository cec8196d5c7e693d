#!/usr/bin/env bash
# Where the CUDA score kernel stalls, per SASS instruction (issue 5: 53% / 63% of copy bandwidth at 1M;
# six blocks per SM, i.e. more warps, was slower in session 10, so the next change needs the
# source-level picture). Nsight Compute on one launch per shape at 1M: warp-state, scheduler,
# occupancy, memory sections and the per-instruction source counters; the report (gzipped) plus
# the SASS page as CSV (stall samples per instruction) and the details page as text.
# One call, ~3 min; time limits sum to 480 s.
# Usage on the device: bash scripts/device/pending10d.sh "$OUT"
set -u
out=${1:?output folder}
mkdir -p "$out"
export PATH=/usr/local/cuda/bin:$PATH PYTHONPATH=$PWD/src
for spec in glm4-9b-1m:4 llama3-8b:4; do
    name=${spec%%:*}
    timeout 180 ncu --section SourceCounters --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section LaunchStats --section ComputeWorkloadAnalysis \
        -k regex:score_kernel -c 1 -f -o "$out/$name" python scripts/device/mma_probe.py --ncu "$spec" \
        > "$out/$name.log" 2>&1
    echo "$name ncu exit $?"
    timeout 30 ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_sass.csv" 2>&1
    timeout 30 ncu -i "$out/$name.ncu-rep" --page details > "$out/${name}_details.txt" 2>&1
    gzip -f "$out/$name.ncu-rep" "$out/${name}_sass.csv"
    grep -E "Duration|DRAM Throughput|Issue Slots Busy|Achieved Occupancy|Registers Per Thread|Eligible Warps" \
        "$out/${name}_details.txt" | head -12
done
ls -la "$out"
