"""Tokens out: decoding from a checkpoint (decoding.py, loading.py), prompts and outputs
(prompts.py), and execution-based scoring of generated programs (execution.py, pass_at_k.py)."""
