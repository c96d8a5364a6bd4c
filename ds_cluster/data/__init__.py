"""Floor 1, what a job reads in: instruction and chat records as token datasets, tokenizers' special tokens,
and local checkpoints. Imports only the root."""
