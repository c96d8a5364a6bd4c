"""Floor 5, the plan: budget per cluster, selection inside clusters, loss weights, placement over steps x
ranks x micro-steps, composed into a Plan. Pure numpy, no torch: every rank builds the same plan."""
