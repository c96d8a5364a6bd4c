"""A stand-in for torchaudio, put into .venv-llamafactory only by launch/frontend_env.sh; it is not torchaudio.

LLaMA-Factory 0.9.5 imports torchaudio when it starts (its audio plugin, llamafactory/data/mm_plugin.py), even for
text. No torchaudio release on PyPI matches torch 2.13.0 (the newest, 2.11.1, fails to load its library with it), so
this empty module lets LLaMA-Factory start. Text training never calls it; anything that does (audio data) gets an
error saying so. transformers finds the module (it only looks for one), but none of its text code calls it.
"""

__version__ = "0.0.0+ds-cluster-stand-in"


def __getattr__(name: str):
    raise RuntimeError(f"torchaudio.{name}: this environment has ds_cluster's stand-in for torchaudio (no torchaudio "
                       "release matches torch 2.13.0), which trains on text only; audio data needs a real torchaudio")
