import pytest
from helpers import run_wide_directory


@pytest.fixture(scope="session")
def shared_compile_cache(tmp_path_factory) -> dict[str, str]:
    """Environment for subprocess runs of scripts/generate.py that share one persistent compilation cache
    (under pytest's tmp, never ~/.cache; one for every pytest-xdist worker): a later run of the same model, in
    any worker, loads its programs instead of compiling."""
    return {
        "LING_JAX_NO_COMPILE_CACHE": "",
        "JAX_COMPILATION_CACHE_DIR": str(run_wide_directory(tmp_path_factory, "generate-compile-cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
