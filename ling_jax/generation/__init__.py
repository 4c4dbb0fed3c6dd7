"""Generation: the `Generator` (`generator`), sampling, tokenizers, cache budgets, a mesh-placed model
(`sharded`) and the `ling-generate` / `scripts/generate.py` command line (`cli` and its helpers)."""
