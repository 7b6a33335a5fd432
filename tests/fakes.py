"""Stand-ins for a TPU slice on this machine: a `gcloud` that runs `tpu-vm ssh --command`
locally and copies for `tpu-vm scp`, and the launch script engine=tpu_vm writes for it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from omegaconf import OmegaConf

# Runs the worker command of `gcloud compute tpus tpu-vm ssh NAME ... --command=CMD` here
# (one worker), records its process id, and passes its exit status on as gcloud does.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
cmd=""; args=()
for a in "$@"; do case "$a" in --command=*) cmd="${a#--command=}";; *) args+=("$a");; esac; done
case "${args[3]}" in
  ssh) bash -c "$cmd" & pid=$!; echo "$pid" > "$FAKE_SLICE_DIR/worker.pid"; wait "$pid";;
  scp) src="${args[4]}"; dst="${args[5]#*:}"; mkdir -p "$(dirname "$dst")"; cp "$src" "$dst";;
  *) echo "fake gcloud: unsupported ${args[*]}" >&2; exit 3;;
esac
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def fake_slice(root: Path) -> dict[str, str]:
    """The environment of a launch script run against the fake gcloud under root/bin."""
    (root / "bin").mkdir(parents=True, exist_ok=True)
    executable(root / "bin" / "gcloud", FAKE_GCLOUD)
    return dict(os.environ, PATH=f"{root / 'bin'}:{os.environ['PATH']}",
                FAKE_SLICE_DIR=str(root))


def launch_script(root: Path, gin_path: Path, model_dir: Path, python: str,
                  builds: tuple[str, ...] = (), **engine) -> Path:
    """The engine=tpu_vm launch script for one fake host (v5e-4: one worker), building
    `builds` (capibara-exp-data's datasets) first."""
    from capibara_exp.base.paths import CONF_DIR
    from capibara_exp.launch import tpu_vm

    defaults = OmegaConf.load(CONF_DIR / "engine" / "tpu_vm.yaml")
    cfg = OmegaConf.create({
        "name": "torture", "topology": "v5e-4", "model_dir": str(model_dir),
        "engine": {**OmegaConf.to_container(defaults, resolve=False), "runtime": "local",
                   "tpu_name": "fake", "zone": "here", "workdir": str(root / "shared"),
                   "model_dir": str(model_dir), "python": python, **engine}})
    topology = tpu_vm.check(cfg)
    path = root / "launch_tpu_vm.sh"
    path.write_text(tpu_vm.script(cfg, topology, str(gin_path), "run", list(builds)))
    return path
