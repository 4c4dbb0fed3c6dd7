"""benchmarks.variants: the launch-setting patches `benchmarks.generate --variants` times in the model, parsed with
one clear error, applied over every entry of the tables the kernels read when traced, undone by the empty
variant."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from benchmarks import variants
from pallas_kernels.fp8 import tuned as fp8_tuned
from pallas_kernels.kda import tuned as kda_tuned
from pallas_kernels.mla.gpu_triton import decode as mla_decode
from pallas_kernels.moe import tuned as moe_tuned
from pallas_kernels.tuning import lookup


def test_a_variant_patches_every_entry_of_its_tables_and_the_mla_splits_until_reset():
    tables = (fp8_tuned.WEIGHT_ONLY_GEMV, moe_tuned.ROUTED_DOWN_QUANTIZED, kda_tuned.DECODE_FUSED_GPU)
    shipped = [{key: entry.params for key, entry in table.items()} for table in tables]
    shipped_min_split = mla_decode.MIN_SPLIT
    patches = variants.parse(
        "gemv.min_programs=1056:gemv.blocks_per_step=3:moe_down.in_flight=2:kda_decode.value_splits=2:mla.min_split=64"
    )
    assert list(patches.values()) == [1056, 3, 2, 2, 64]
    try:
        label = variants.apply(patches)
        assert label == (
            ", gemv.min_programs 1056, gemv.blocks_per_step 3, moe_down.in_flight 2, kda_decode.value_splits 2, "
            "mla.min_split 64"
        )
        for bucket in ("one_row", "fma_rows", "dot_rows"):
            tiles = lookup(fp8_tuned.WEIGHT_ONLY_GEMV, dtype=jnp.bfloat16, bucket=bucket)
            assert (tiles.min_programs, tiles.blocks_per_step) == (1056, 3)
        for bucket in ("one_token", "tokens"):
            assert lookup(moe_tuned.ROUTED_DOWN_QUANTIZED, dtype=jnp.bfloat16, bucket=bucket).in_flight == 2
        assert lookup(kda_tuned.DECODE_FUSED_GPU, dtype=jnp.bfloat16).value_splits == 2
        assert mla_decode.MIN_SPLIT == 64
        assert mla_decode.default_num_splits(1, 1, 8192) == 128  # 8192 / 64, under 264 programs
    finally:
        assert variants.apply({}) == ""
    assert [{key: entry.params for key, entry in table.items()} for table in tables] == shipped
    assert mla_decode.MIN_SPLIT == shipped_min_split


@pytest.mark.parametrize("text", ["gemv.sum_k=-1", "gemv.min_programs=x", "mla.block_k=6", "min_programs=8"])
def test_a_bad_variant_names_what_is_expected(text):
    with pytest.raises(ValueError, match=r"expected TARGET\.FIELD=INTEGER with TARGET\.FIELD one of gemv\.block_o"):
        variants.parse(text)
