"""Floor 6, training time: one rank's loader over a plan with a resumable state, the weighted loss, and
learning-rate schedules whose length comes from the plan."""
