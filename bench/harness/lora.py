"""The LoRA recipe (`--recipe peft=lora`): the adapter folder the
`recommended_lora` arm's `lora` features are computed from (the trained model with untrained adapters, as LESS
computes its features from LoRA gradients)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

# The adapters the features are read through: one seed for every arm and run on a mixture, as the features are
# extracted once per mixture (a seed changes the data order and the clustering, not the feature space).
FEATURE_ADAPTER_SEED = 0


def ensure_feature_adapters(folder: Union[str, os.PathLike], base_model: Union[str, os.PathLike], rank: int) -> Path:
    """FOLDER, a PEFT adapter folder over the local `base_model` with seeded rank-`rank` adapters, written once
    (one process: the job's rank 0). Loading it anywhere a model folder is taken gives the base model with these
    adapters, trainable (ds_cluster.data.models.load_model)."""
    from ds_cluster.data.models import ADAPTER_CONFIG, load_model, with_lora

    folder = Path(folder)
    if (folder / ADAPTER_CONFIG).is_file():
        return folder
    model = with_lora(load_model(base_model), rank, seed=FEATURE_ADAPTER_SEED)
    # save_pretrained names the base by the folder it was loaded from: the local checkpoint, nothing to download.
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial)
    partial.rename(folder)
    return folder
