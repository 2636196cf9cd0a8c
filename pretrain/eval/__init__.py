"""Evaluation: lm-eval-harness adapter (harness), task suites and offline task data (tasks),
the task suite run on a checkpoint and in the training loop (suite), validation loss and bits
per byte (metrics), a checkpoint's validation loss and loss at each length (validation), the
paper's tables (tables), one checkpoint's evaluation and its report (checkpoint_eval), several
runs compared (compare), passkey retrieval over length x depth (passkey)."""
