"""The demo checkpoint in-process and `Generator` references: what a request gives when run alone."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ling_jax import load_hf_checkpoint, load_model_config
from ling_jax.generation.cli import DEMO_DIR
from ling_jax.generation.generator import Generator
from ling_jax.generation.sampling import SamplingParams
from ling_jax.generation.tokenizer import load_tokenizer
from ling_jax.policy import ExecutionPolicy, FP8Matmul

BATCH_INVARIANT = ExecutionPolicy(fp8_matmul=FP8Matmul.WEIGHT_ONLY)


@pytest.fixture(scope="module")
def demo_model():
    """The demo checkpoint in the batch-invariant mode (`fp8_matmul="weight_only"`, ling-serve's `--fp8-matmul
    weight_only`), in which a served request equals the request run alone on every backend: under the default
    (auto) a GPU multiplies prefill-sized calls in W8A8, so a token's output depends on its call's rows."""
    return load_hf_checkpoint(DEMO_DIR, dtype=jnp.float32, progress=False, policy=BATCH_INVARIANT)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return load_tokenizer(DEMO_DIR, load_model_config(DEMO_DIR))


class Alone:
    """Each request run alone through `Generator` (batch 1), the reference a served request must equal."""

    def __init__(self, model, tokenizer, prefill_chunk: int):
        self.generator = Generator(model, prefill_chunk=prefill_chunk)
        self.eos_ids = tokenizer.eos_ids

    def __call__(self, prompt: list[int], sampling: SamplingParams, max_tokens: int) -> list[int]:
        outputs, _ = self.generator.generate([prompt], [sampling], max_tokens, eos_ids=self.eos_ids)
        return outputs[0]


@pytest.fixture(scope="module")
def alone(demo_model, demo_tokenizer):
    """alone(prefill_chunk) -> the `Alone` reference with that chunk (the served engine's)."""
    return lambda prefill_chunk: Alone(demo_model, demo_tokenizer, prefill_chunk)
