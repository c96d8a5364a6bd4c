"""Floor 4, the analysis: features and clusters written to a folder that plans are built from (`folder`, the
one owner of its format) and the collective step that computes it with an engine (`compute`)."""
