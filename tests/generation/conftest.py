import pytest


@pytest.fixture(scope="session")
def shared_compile_cache(tmp_path_factory) -> dict[str, str]:
    """Environment for subprocess runs of scripts/generate.py that share one persistent compilation cache
    (under pytest's tmp, never ~/.cache): a later run of the same model loads its programs instead of compiling."""
    return {
        "LING_JAX_NO_COMPILE_CACHE": "",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
