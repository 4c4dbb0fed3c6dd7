"""ling-convert: HF-format FP8/MXFP4 safetensors shards -> sharded Orbax checkpoints."""


class ConvertError(Exception):
    """The conversion cannot go on; the message names the file, tensor or flag and says what to do."""
