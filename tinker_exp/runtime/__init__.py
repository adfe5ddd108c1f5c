"""The runtime: verl and Ray wiring (worker group, CPU platform plugin), the model and tokenizer.

The only package that imports torch, verl, ray or transformers; everything above it stays importable without them.
"""
