"""Floor 2, per-sample gradient features from the engine's forward pass (torch, any ZeRO stage): the kinds
and their projection, the extraction over the ranks, its resumable store, and a separate feature model."""
