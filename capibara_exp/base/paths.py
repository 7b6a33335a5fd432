"""Where the shipped configs are: data inside the package, the same place in a checkout and
in an installed copy."""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # capibara_exp/

CONF_DIR = _PACKAGE / "conf"  # Hydra's config dir: conf/config.yaml and the config groups
GIN_DIR = _PACKAGE / "gin"  # the gin templates the configs render into
# The root holding sweeps/: on Hydra's search path, its sweeps/ is the config group `sweeps`
# (search spaces, kept apart from conf/ because they set hydra.sweeper only).
SWEEPS_ROOT = _PACKAGE / "sweeping" / "conf"
# A source checkout (editable install): bench/ and pyproject.toml beside the package.
CHECKOUT = _PACKAGE.parent if (_PACKAGE.parent / "pyproject.toml").is_file() else None
