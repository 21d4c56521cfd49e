#!/bin/bash
# ncu of our Hopper backward kernel and FlashAttention-4's on the same shapes (issue 47: profile both before
# changing anything), with per-instruction counts and stall samples (SourceCounters). On the device, from the
# repository root, after the build, carrying benchmarks/fa4/pkg:
#     [WHO="ours fa4"] bash benchmarks/fa4/ncu_backward.sh ["B H N D causal" ...]
# Leaves $OUT/ncu_backward.tgz: per report the details page (.txt), the raw metrics and the SASS source page
# (.csv: executed count and stall samples of every instruction).
source benchmarks/fa4/site.sh || exit 2
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
METRICS=smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,lts__t_sectors_op_red.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum
DIR=/tmp/ncu_backward; mkdir -p $DIR
SHAPES=("$@"); [ ${#SHAPES[@]} -eq 0 ] && SHAPES=("4 16 4096 128 1" "4 16 4096 128 0" "4 32 4096 64 0")
for shape in "${SHAPES[@]}"; do
  for who in ${WHO:-ours fa4}; do
    tag="${who}_$(echo $shape | tr ' ' _)"
    timeout 150 ncu --launch-skip 1 --launch-count 1 -k regex:'attention_backward_kernel|BackwardSm90' \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats --section SourceCounters \
      --metrics $METRICS -o $DIR/$tag -f python3 benchmarks/fa4/ncu_backward_call.py $who $shape > $DIR/$tag.log 2>&1
    ncu -i $DIR/$tag.ncu-rep --page details > $DIR/$tag.txt 2>&1
    ncu -i $DIR/$tag.ncu-rep --page raw --csv > $DIR/$tag.raw.csv 2>&1
    ncu -i $DIR/$tag.ncu-rep --page source --csv --print-source sass > $DIR/$tag.sass.csv 2>&1
    echo "$tag at ${SECONDS}s: $(grep -E '^\s+Duration' $DIR/$tag.txt | head -1)"
  done
done
(cd $DIR && tar czf $OUT/ncu_backward.tgz *.txt *.csv *.log)
