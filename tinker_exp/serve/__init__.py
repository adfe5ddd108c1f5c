"""The Tinker API served on tinker_exp's workers: ``python -m tinker_exp.serve`` (docs/serve.md)."""
