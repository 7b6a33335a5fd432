"""Where the shipped conf/ and gin/ directories are, installed or in a checkout.

A wheel installs them inside the package (capibara_exp/conf and capibara_exp/gin_templates);
a checkout or an editable install has them at the top level.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # capibara_exp/


def _find(top_level: str, installed: str) -> Path:
    for candidate in (_PACKAGE / installed, _PACKAGE.parent / top_level):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"capibara-exp is installed without its {top_level}/ directory "
                            f"(looked in {_PACKAGE / installed} and {_PACKAGE.parent / top_level})")


CONF_DIR = _find("conf", "conf")
GIN_DIR = _find("gin", "gin_templates")
# The directory holding sweeps/: on Hydra's search path, its sweeps/ is the group `sweeps`.
SWEEPS_ROOT = _find("sweeps", "sweeps").parent
