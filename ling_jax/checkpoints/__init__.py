"""Checkpoint IO: HF safetensors shards (`hf`, `safetensors_io`, `names`; loaded slice by slice onto a mesh
through `pieces`), converted Orbax checkpoints (`orbax`) and the per-tensor NaN/Inf check (`finite_check`)."""
