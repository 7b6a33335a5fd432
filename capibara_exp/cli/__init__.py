"""The console scripts, one module each, on a common shell (common.py).

capibara-exp (main.py), capibara-exp-data (data.py), capibara-exp-merge (merge.py),
capibara-exp-tune-mesh (tune_mesh.py), capibara-exp-plot (plot.py). Each composes its
config and calls one library function; only Hydra, OmegaConf and the pure gin bridge are
imported before that, so `--help` and `--cfg job` answer without loading JAX or SeqIO.
"""
