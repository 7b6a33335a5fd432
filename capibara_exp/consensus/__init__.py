"""Consensus merging of checkpoints: soups, robust aggregation, learned weights, FedAvg.

Kept import-light: gin files import `capibara_exp.consensus.action`, and the modules
load JAX, Orbax and SeqIO only when they are used.
"""
