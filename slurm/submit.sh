#!/bin/bash
# Submit a training job and its evaluation; the evaluation starts only once the training job
# has COMPLETED (pre-emptions and requeues in between keep it waiting; a failure cancels it).
#
#   slurm/submit.sh NAME [--set key=value ...]     # NAME as in slurm/NAME.sh, e.g. llama1b_rope10
#   slurm/submit.sh path/to/job.sh [--set ...]     # any job script that calls slurm/launch.sh
#
# Equivalent to:
#   job=$(sbatch --parsable slurm/NAME.sh [--set ...])
#   sbatch --dependency=afterok:$job slurm/evaluate.sh RUN_DIR
# Options for both jobs go in the environment: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS.
# Options for tools/evaluate.py: PRETRAIN_EVAL_ARGS (e.g. "--data-dir /shared/evals").
set -euo pipefail

arg=${1:?usage: slurm/submit.sh NAME|JOB_SCRIPT [--set key=value ...]}
shift
if [ -f "$arg" ]; then script=$(readlink -f "$arg"); fi
cd "$(dirname "$0")/.."
if [ -z "${script:-}" ]; then
  name=${arg#slurm/}
  script=slurm/${name%.sh}.sh
  [ -f "$script" ] || { echo "submit: no job script $script; see: python tools/study.py list studies/partial_rope.yaml" >&2; exit 2; }
fi
name=$(basename "$script" .sh)
config=$(sed -n 's|^exec slurm/launch.sh \([^ ]*\) .*|\1|p' "$script")
[ -n "$config" ] || { echo "submit: $script does not call slurm/launch.sh CONFIG" >&2; exit 2; }
# shellcheck source=slurm/env.sh
source slurm/env.sh
run_dir=$("${PY[@]}" tools/study.py run-dir "$config" "$@")
mkdir -p "$run_dir"

train=$(sbatch --parsable "$script" "$@")
train=${train%%;*}
# shellcheck disable=SC2086  # PRETRAIN_EVAL_ARGS is a list of options
evaluate=$(sbatch --parsable --dependency=afterok:"$train" --kill-on-invalid-dep=yes \
  --job-name="eval_$name" slurm/evaluate.sh "$run_dir" ${PRETRAIN_EVAL_ARGS:-})
evaluate=${evaluate%%;*}
echo "training:   job $train ($script, run folder $run_dir)"
echo "evaluation: job $evaluate (starts after job $train completes)"
