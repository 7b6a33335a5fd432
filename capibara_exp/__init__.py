"""capibara-exp: Hydra experiment configs -> T5X gin -> JAX training, sweeps and merging."""

import glob as _glob
import importlib.util as _importlib_util
import os as _os

__version__ = "0.1.0"


def _no_tpu_probe() -> None:
    """With libtpu installed (for ahead-of-time compiles) but no TPU attached, JAX would probe
    for one at start-up: about a second and libtpu's error lines on every run. Pick the
    platforms JAX starts with unless the user did; a TPU VM (TPU device files) is untouched,
    and so is a machine with a GPU plugin, where JAX's own choice stays."""
    if _os.environ.get("JAX_PLATFORMS") or _os.environ.get("JAX_PLATFORM_NAME"):
        return
    if _importlib_util.find_spec("libtpu") is None:
        return
    if _glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*"):
        return
    if any(_importlib_util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin",
                                                  "jax_rocm60_plugin")):
        return
    _os.environ["JAX_PLATFORMS"] = "cpu"


_no_tpu_probe()
