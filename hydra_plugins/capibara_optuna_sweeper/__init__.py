"""Hydra plugin: the capibara_optuna sweeper (implementation in capibara_exp.sweeping)."""
