"""Where the shipped conf/, gin/ and sweeps/ directories are, installed or in a checkout."""

from importlib import resources
from pathlib import Path


def _package_dir(name: str) -> Path:
    return Path(str(resources.files(f"capibara_exp.{name}")))


CONF_DIR = _package_dir("conf")
GIN_DIR = _package_dir("gin_templates")
SWEEPS_DIR = _package_dir("sweeps")
