"""ling-convert: HF-format FP8/MXFP4 safetensors shards -> sharded Orbax checkpoints."""
