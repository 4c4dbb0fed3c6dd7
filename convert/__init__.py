"""ling-convert: HF-format FP8/MXFP4 safetensors shards -> sharded Orbax checkpoints."""

BF16 = "bf16"  # --dtype: dequantise everything to bfloat16
FP8_KEPT = "fp8"  # --dtype: keep FP8 weights (and MXFP4 experts as FP8 codes) with their block scales


class ConvertError(Exception):
    """The conversion cannot go on; the message names the file, tensor or flag and says what to do."""
