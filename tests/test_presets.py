"""The published presets against the published checkpoint size (block-FP8 bytes by plain arithmetic over the
widths, `tests/support/checkpoint_bytes.py`) and their clip lists."""

import pytest
from checkpoint_bytes import checkpoint_bytes

from ling_jax.presets import preset

PUBLISHED_3_1_FLASH_BYTES = 573_753_281_152  # the FP8 checkpoint's index total_size (spec §0)


def test_ling_3_1_flash_checkpoint_is_the_published_size():
    c = preset("ling-3.1-flash")
    assert (c.moe_intermediate_size, c.intermediate_size, c.vocab_size) == (1280, 10240, 157184)
    assert checkpoint_bytes(c) == pytest.approx(PUBLISHED_3_1_FLASH_BYTES, rel=1e-3)


def test_the_old_widths_were_far_short():
    """Expert width 1024 / dense 12288 (the preset before the publication) is 19% short: the test can tell."""
    c = preset("ling-3.1-flash").replace(moe_intermediate_size=1024, shared_expert_intermediate_size=1024)
    assert checkpoint_bytes(c.replace(intermediate_size=12288)) < 0.82 * PUBLISHED_3_1_FLASH_BYTES


def test_clip_lists_reach_the_late_layers_only():
    c31, c30 = preset("ling-3.1-flash"), preset("ling-3.0-flash")
    assert [i for i in range(73) if c31.swiglu_limit(i, shared=True)] == list(range(64, 72))
    assert [i for i in range(73) if c31.swiglu_limit(i, shared=False)] == list(range(65, 72))
    assert {c30.swiglu_limit(i, shared=True) for i in range(34, 40)} == {5.0}
    assert c30.swiglu_limit(40, shared=True) == c30.swiglu_limit(41, shared=True) == 7.0
    assert [i for i in range(43) if c30.swiglu_limit(i, shared=False)] == list(range(35, 42))
    assert preset("ling-3.0-flash-vl").share_expert_swiglu_limit_list == c30.share_expert_swiglu_limit_list
