"""Optuna sweeps under Hydra multirun (the capibara_optuna sweeper's implementation)."""
