"""Checkpoint IO: HF safetensors shards (`hf`, `safetensors_io`, `names`), converted Orbax checkpoints
(`orbax`) and the per-tensor NaN/Inf check (`finite_check`)."""
