"""Evaluation: lm-eval-harness adapter (harness), task suites and offline task data (tasks),
validation loss and bits per byte (metrics), the paper's tables (tables), one checkpoint's
evaluation (suite), several runs compared (compare), passkey retrieval over length x depth
(passkey)."""
