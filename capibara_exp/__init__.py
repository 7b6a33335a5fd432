"""capibara-exp: Hydra experiment configs -> T5X gin -> JAX training, sweeps and merging."""

__version__ = "0.1.0"
