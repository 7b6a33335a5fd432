"""capibara-exp: Hydra experiment configs -> T5X gin -> JAX training, sweeps and merging.

Importing the package changes nothing in the process; entry points set up the environment
(capibara_exp/base/environment.py) in their `main`.
"""

__version__ = "0.1.0"
