"""Floor 3, clusters in feature space: k-means with the paper's capacity cap (`kmeans`), in one process or
over the ranks' own rows (`sharded`). Pure numpy / scikit-learn / faiss; the ranks come in as a Collectives."""
