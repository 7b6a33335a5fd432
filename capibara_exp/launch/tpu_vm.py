"""engine=tpu_vm: the multi-host launch script for a Cloud TPU VM slice.

Every worker (host) of the slice runs the same config.gin: the script copies it to each
worker, then runs one command on all of them at once (`gcloud ... ssh --worker=all`), with
the model dir and the data dir on storage every worker sees. JAX joins the workers itself
(`jax.distributed.initialize()` detects a TPU slice): T5X does it in t5x.train; the local
engine's worker entry (`python -m capibara_exp.runtime`) does it with mode auto.
"""

from __future__ import annotations

import shlex
from typing import Any

from capibara_exp import topologies
from capibara_exp.errors import ConfigError
from capibara_exp.topologies import Topology

RUNTIMES = ("t5x", "local")
SCRIPT = "launch_tpu_vm.sh"
# The TPU VM software version for each chip (gcloud's --version).
RUNTIME_VERSIONS = {"TPU v5 lite": "v2-alpha-tpuv5-lite", "TPU v6 lite": "v2-alpha-tpuv6e",
                    "TPU v5": "v2-alpha-tpuv5", "TPU v4": "tpu-ubuntu2204-base"}


def check(cfg: Any) -> Topology:
    """The slice the experiment declares, and settings errors naming their keys."""
    e = cfg.engine
    try:
        topology = topologies.get(str(cfg.topology))
    except ValueError as err:
        raise ConfigError(f"engine=tpu_vm needs a TPU slice in `topology`: {err}") from err
    if topology.num_slices > 1:
        raise ConfigError(f"engine=tpu_vm launches one slice; topology={cfg.topology} is "
                          f"{topology.num_slices} slices over DCN (plan it with "
                          "capibara-exp-tune-mesh; a multi-slice launch is not written here)")
    if e.runtime not in RUNTIMES:
        raise ConfigError(f"engine.runtime: '{e.runtime}' is not one of {list(RUNTIMES)}")
    shared = str(e.workdir)
    if not shared.startswith("/"):
        raise ConfigError(f"engine.workdir={shared}: give the absolute path of storage every "
                          "worker mounts (e.g. /mnt/shared on a Filestore or gcsfuse mount)")
    model_dir = str(cfg.model_dir)
    if not (model_dir.startswith(shared.rstrip("/") + "/")
            or (e.runtime == "t5x" and model_dir.startswith("gs://"))):
        raise ConfigError(f"model_dir={model_dir} is not on the workers' shared storage "
                          f"(engine.workdir={shared}"
                          + (", or gs:// for runtime t5x)" if e.runtime == "t5x" else ")"))
    return topology


def worker_command(cfg: Any, gin_path: str, data_dir: str) -> str:
    """What every worker runs: the same gin, JAX joining the workers."""
    e = cfg.engine
    if e.runtime == "t5x":
        run = [e.python, "-m", "t5x.train", f"--gin_file={gin_path}", "--alsologtostderr",
               *list(e.extra_flags)]
    else:
        run = [e.python, "-m", "capibara_exp.runtime", gin_path, "--distributed=auto"]
    steps = [line for line in str(e.setup).splitlines() if line.strip()]
    steps += [f"export CAPIBARA_DATA_DIR={shlex.quote(data_dir)}", shlex.join(run)]
    return " && ".join(steps)


def script(cfg: Any, topology: Topology, gin_text_path: str, run_name: str) -> str:
    """The bash script: copy config.gin to every worker, then run on all workers."""
    e = cfg.engine
    where = [f"--zone={e.zone}"] + ([f"--project={e.project}"] if e.get("project") else [])
    target = f"{e.workdir.rstrip('/')}/{cfg.name}/{run_name}"
    gin_path = f"{target}/config.gin"
    data_dir = f"{e.workdir.rstrip('/')}/data"
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", e.tpu_name, *where, "--worker=all"]
    scp = ["gcloud", "compute", "tpus", "tpu-vm", "scp", gin_text_path,
           f"{e.tpu_name}:{gin_path}", *where, "--worker=all"]
    create = ["gcloud", "compute", "tpus", "tpu-vm", "create", e.tpu_name, *where,
              f"--accelerator-type={topology.accelerator_type}",
              f"--version={RUNTIME_VERSIONS.get(topology.chip.kind, 'tpu-ubuntu2204-base')}"]
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by capibara-exp (engine=tpu_vm, runtime {e.runtime}) for {cfg.name} on "
        f"{topology.name}: {topology.chips} chips, {topology.hosts} worker host(s).",
        "# The slice, if it does not exist yet:",
        f"#   {shlex.join(create)}",
        f"# Every worker runs the same config.gin ({gin_path}); model dir {cfg.model_dir},",
        f"# data dir {data_dir}: storage every worker mounts.",
        "set -euo pipefail",
        shlex.join([*ssh, f"--command=mkdir -p {shlex.quote(target)}"]),
        shlex.join(scp),
        shlex.join([*ssh, f"--command={worker_command(cfg, gin_path, data_dir)}"]),
        "",
    ])
