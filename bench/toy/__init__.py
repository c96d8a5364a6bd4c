"""The toy world of the demo, the tests and the benchmark: nothing in the core imports it.

A tiny Llama with a character tokenizer (`models`, `tokenizer`), a synthetic
instruction mixture whose answers can be checked exactly (`tasks`, shipped in
`data/default`), and per-family evaluation (`evaluate`). It plays the part a
real checkpoint and a real dataset play for a user, the way
`sklearn.datasets` does for scikit-learn.
"""
