"""tinker_exp: config-driven Tinker-style LLM training on verl."""

__version__ = "0.1.0"
