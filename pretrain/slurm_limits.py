"""Slurm time limits: reading `#SBATCH --time` and the limit a planned run asks for.

Below both the planner (its paper tables) and the studies (their job scripts), which must
not import each other.
"""

from __future__ import annotations

import math

# A planned run's --time: its planned run time x SLURM_MARGIN + 0.5 h (start, saves), rounded
# up, at most SLURM_MAX_HOURS (the planner's paper tables use the same rule).
SLURM_MARGIN = 1.25
SLURM_MAX_HOURS = 48


def time_limit_hours(executed_run_hours: float) -> int:
    """Hours for a run's `#SBATCH --time`: its run time on *executed* FLOPs (recompute costs
    time) x SLURM_MARGIN + 0.5 h, rounded up, at most SLURM_MAX_HOURS."""
    return min(SLURM_MAX_HOURS, math.ceil(executed_run_hours * SLURM_MARGIN + 0.5))


def time_limit_s(text: str) -> int:
    """Seconds of a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:  # after "D-" the clock starts with hours
        h, m, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + m * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    return sum(p * 60**i for i, p in enumerate(reversed(parts)))
