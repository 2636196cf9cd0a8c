"""Train a model: `python pretrain/main.py --config configs/quickstart.yaml`.

Every launcher works with the same command line:
    python pretrain/main.py --config X.yaml                    # one process (CPU or one GPU)
    deepspeed pretrain/main.py --config X.yaml                 # all GPUs of this node
    torchrun --nproc_per_node 8 pretrain/main.py --config X.yaml
    srun python pretrain/main.py --config X.yaml               # Slurm: one task per GPU

Re-running the same command resumes from the newest complete checkpoint. Exit codes:
0 when train_iters are done, 99 after SIGTERM/SIGUSR1 (a checkpoint was written; requeue),
124 when no step completed within train.hang_timeout (stacks in RUN/hang/; requeue),
2 for a user error (config, data, path, flag: one line; PRETRAIN_DEBUG=1 for a traceback).
"""

import sys

from pretrain.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
