"""A small serving stack on engram_jax's public API: the toy decoder (model), its
Engram tables (tables), the jitted step and the continuous-batching loop (engine),
and the command line that examples/serve.py and benchmarks/serve.py share (cli).
"""
