"""engine=tpu_vm: the multi-host launch script for a Cloud TPU VM slice.

Every worker (host) of the slice runs the same config.gin: the script copies it to each
worker, then runs one command on all of them at once (`gcloud ... ssh --worker=all`), with
the model dir and the data dir on storage every worker sees. JAX joins the workers itself
(`jax.distributed.initialize()` detects a TPU slice): T5X does it in t5x.train; the local
engine's worker entry (`python -m capibara_exp.runtime`) does it with mode auto.

The script restarts the job when it fails or is preempted, a bounded number of times with
a growing wait, logging each restart to launch_tpu_vm.log beside it; every run resumes
from the newest checkpoint that verifies (the local runtime; T5X restores its latest).
"""

from __future__ import annotations

import shlex
from typing import Any

from capibara_exp.base import topologies
from capibara_exp.base.errors import PREEMPTED_EXIT_CODE, ConfigError
from capibara_exp.base.topologies import LIBTPU_FLAGS_ENV, Topology

RUNTIMES = ("t5x", "local")
SCRIPT = "launch_tpu_vm.sh"
# The TPU VM software version for each chip (gcloud's --version).
RUNTIME_VERSIONS = {"TPU v5 lite": "v2-alpha-tpuv5-lite", "TPU v6 lite": "v2-alpha-tpuv6e",
                    "TPU v5": "v2-alpha-tpuv5", "TPU v4": "tpu-ubuntu2204-base"}


def _check_restarts(e: Any) -> None:
    for key in ("max_restarts", "restart_backoff_s", "restart_backoff_max_s"):
        value = e.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"engine.{key} must be an integer >= 0, got {value!r}")
    if e.restart_backoff_max_s < e.restart_backoff_s:
        raise ConfigError(f"engine.restart_backoff_max_s={e.restart_backoff_max_s} is below "
                          f"engine.restart_backoff_s={e.restart_backoff_s}")


def check(cfg: Any) -> Topology:
    """The slice the experiment declares, and settings errors naming their keys."""
    e = cfg.engine
    _check_restarts(e)
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
    steps += [f"export CAPIBARA_DATA_DIR={shlex.quote(data_dir)}"]
    flags = str(cfg.get("libtpu_init_args") or "").strip()
    if flags:  # the experiment's libtpu flags, after any the worker's environment sets
        steps += [f'export {LIBTPU_FLAGS_ENV}="${{{LIBTPU_FLAGS_ENV}:+${LIBTPU_FLAGS_ENV} }}"'
                  f"{shlex.quote(flags)}"]
    steps += [shlex.join(run)]
    return " && ".join(steps)


def _restart_loop(e: Any, job: list[str], model_dir: str) -> list[str]:
    """Bash that runs the job and restarts it on failure or preemption: at most
    engine.max_restarts times, waiting engine.restart_backoff_s doubled after each restart
    (up to engine.restart_backoff_max_s); a configuration error (exit 2) is not retried.
    Each run resumes from the newest checkpoint in the model dir that verifies."""
    return [
        f"MAX_RESTARTS={int(e.max_restarts)}  # engine.max_restarts",
        f"DELAY_S={int(e.restart_backoff_s)}  # engine.restart_backoff_s, doubled per restart",
        f"MAX_DELAY_S={int(e.restart_backoff_max_s)}  # engine.restart_backoff_max_s",
        f"PREEMPTED={PREEMPTED_EXIT_CODE}  # a worker's exit status after a preemption save",
        'LOG="$(dirname "$0")/launch_tpu_vm.log"',
        'log() { echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) $*" | tee -a "$LOG" >&2; }',
        "restarts=0",
        "while true; do",
        f"  {shlex.join(job)}",
        "  rc=$?",
        '  if [ "$rc" -eq 0 ]; then log "job finished"; exit 0; fi',
        '  if [ "$rc" -eq 2 ]; then log "job failed with a configuration error (exit 2): not '
        'restarted"; exit 2; fi',
        '  why="failed"; if [ "$rc" -eq "$PREEMPTED" ]; then why="was preempted"; fi',
        '  if [ "$restarts" -ge "$MAX_RESTARTS" ]; then',
        '    log "job $why (exit $rc) and $restarts of $MAX_RESTARTS restarts are used: giving up"',
        '    exit "$rc"',
        "  fi",
        "  restarts=$((restarts + 1))",
        f'  log "job $why (exit $rc); restart $restarts of $MAX_RESTARTS in ${{DELAY_S}}s, '
        f'resuming from the newest verified checkpoint in {model_dir}"',
        '  sleep "$DELAY_S"',
        "  DELAY_S=$((DELAY_S * 2 > MAX_DELAY_S ? MAX_DELAY_S : DELAY_S * 2))",
        "done",
    ]


def build_command(cfg: Any, data_dir: str, builds: list[str]) -> str:
    """What worker 0 runs once before the job: capibara-exp-data builds the data the run
    reads (`builds`, its `datasets` names) into the shared data dir; the workers only read."""
    e = cfg.engine
    build = [e.python, "-m", "capibara_exp.cli.data", f"data_dir={data_dir}",
             f"datasets=[{','.join(builds)}]"]
    steps = [line for line in str(e.setup).splitlines() if line.strip()]
    return " && ".join([*steps, shlex.join(build)])


def script(cfg: Any, topology: Topology, gin_text_path: str, run_name: str,
           builds: list[str] = ()) -> str:
    """The bash script: copy config.gin to every worker, build the data the run reads
    (`builds`) on worker 0 into the shared data dir, then run on all workers, restarting
    the job when it fails or is preempted."""
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
    job = [*ssh, f"--command={worker_command(cfg, gin_path, data_dir)}"]
    build = [*ssh[:-1], "--worker=0", f"--command={build_command(cfg, data_dir, builds)}"]
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Written by capibara-exp (engine=tpu_vm, runtime {e.runtime}) for {cfg.name} on "
        f"{topology.name}: {topology.chips} chips, {topology.hosts} worker host(s).",
        "# The slice, if it does not exist yet:",
        f"#   {shlex.join(create)}",
        f"# Every worker runs the same config.gin ({gin_path}); model dir {cfg.model_dir},",
        f"# data dir {data_dir}: storage every worker mounts.",
        "set -uo pipefail",
        shlex.join([*ssh, f"--command=mkdir -p {shlex.quote(target)}"]) + " || exit",
        shlex.join(scp) + " || exit",
        *([shlex.join(build) + " || exit"] if builds else []),
        *_restart_loop(e, job, str(cfg.model_dir)),
        "",
    ])
