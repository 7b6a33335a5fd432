"""Start-up: `--help`, `--cfg job` and a one-key mistake against `python -c "import hydra"`
(goal <= 2x); then the edit-run loop: wall time of `capibara-exp debug=fast` run again
(XLA's compile cache and the data from the first run in place) against the first run, and
against real T5X training the same config.gin where T5X is installed. Goal: the repeated
run within 10 s on a 2-core CPU machine.

    python bench/startup.py [--repeats 3] [--config-only] [--no-bytecode]

Each run is a new process with a new run dir, as a user's is; the first uses an empty
cache dir ($XDG_CACHE_HOME) and data dir. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_S = 10.0
COMMAND = [sys.executable, "-m", "capibara_exp.cli", "debug=fast"]


CPU_S: list[float] = []  # CPU seconds (user + system) of each run, beside its wall time


def timed(cmd: list[str], env: dict[str, str], cwd: Path) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return wall


def t5x_wall(root: Path, env: dict[str, str], repeats: int) -> float | None:
    """Real T5X (`python -m t5x.train`) on the config.gin capibara-exp renders for it, each
    run in a new model dir; the first run warms its caches too."""
    if importlib.util.find_spec("t5x") is None:
        return None
    rendered = root / "t5x_first"
    timed([*COMMAND, "engine=t5x", f"model_dir={rendered}"], env, root)
    text = (rendered / "config.gin").read_text()
    walls = []
    for i in range(repeats):
        model_dir = root / f"t5x_{i}"
        gin = root / f"t5x_{i}.gin"
        gin.write_text(re.sub(r"^MODEL_DIR = .*$", f"MODEL_DIR = '{model_dir}'", text,
                              flags=re.M))
        walls.append(timed([sys.executable, "-m", "t5x.train", f"--gin_file={gin}"], env, root))
    return statistics.median(walls)


# The commands that must cost about what Hydra itself costs: they import no JAX, TensorFlow
# or SeqIO (tests/test_cli.py checks sys.modules). Goal: within CONFIG_GOAL x the baseline.
CONFIG_COMMANDS = {"--help": ["--help"], "--cfg job": ["--cfg", "job"],
                   "a one-key mistake": ["model.emb_dm=64"]}
CONFIG_GOAL = 2.0
# How each is run: "kept", the same line again (its composition kept by its first run);
# "new line", a line never run before that sets a value more than a line run before (a new
# random_seed each time: cli/compose_rest.py); "new choice", a line never run before whose
# group choices were never composed (ema=default and a new random_seed: Hydra composes, from
# the config files earlier commands read: cli/parsed_cache.py); "cold", nothing kept at all
# (CAPIBARA_COMPOSE_CACHE=0: a first command, or every command with the caches off).
WAYS = {"kept": [], "new line": ["random_seed={seed}"],
        "new choice": ["ema=default", "random_seed={seed}"], "cold": []}


def config_paths(repeats: int, cwd: Path, bytecode: bool) -> bool:
    """Wall time of each config command against `python -c "import hydra"`, measured
    alternately in the same run (so load hits both alike); medians. True if within goal.
    CPU seconds (user + system) are printed beside: on a busy machine they are close to
    what a quiet one's wall time would be. Each command is timed in each of WAYS (in a new
    cache dir). `bytecode`: every process, the baseline's too, runs from the bytecode
    Python keeps (in cwd, written by the first runs), as an installed package does, even
    where the environment says PYTHONDONTWRITEBYTECODE (then capibara_exp's own modules,
    from an editable install, would be compiled anew by every command)."""
    base_cmd = [sys.executable, "-c", "import hydra"]
    cli = [sys.executable, "-m", "capibara_exp.cli"]
    kept = {**os.environ, "XDG_CACHE_HOME": str(cwd / "cache"), "CAPIBARA_COMPOSE_CACHE": "1"}
    if bytecode:
        kept.pop("PYTHONDONTWRITEBYTECODE", None)
        kept["PYTHONPYCACHEPREFIX"] = str(cwd / "pycache")
    cold = {**kept, "CAPIBARA_COMPOSE_CACHE": "0"}
    runs = [("baseline", lambda i: base_cmd, kept)]
    for k, (name, args) in enumerate(CONFIG_COMMANDS.items()):
        for way, more in WAYS.items():
            runs.append((f"{name} ({way})", lambda i, a=[*args, *more], k=k: [
                *cli, *(x.format(seed=1000 * k + i + 1) for x in a)],
                cold if way == "cold" else kept))
    for _, cmd, env in [runs[0], *runs[1::len(WAYS)]]:  # each line's first run keeps it
        subprocess.run(cmd(0), cwd=cwd, env=env, capture_output=True)
    walls: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    cpus: dict[str, list[float]] = {name: [] for name in walls}
    for i in range(1, repeats + 1):
        for name, cmd, env in runs:
            wall, cpu = _wall(cmd(i), cwd, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    base, base_cpu = statistics.median(walls["baseline"]), statistics.median(cpus["baseline"])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores after the config "
          f"commands (wall times grow with it); bytecode kept: {'yes' if bytecode else 'no'}")
    print(f"python -c 'import hydra' (median of {repeats}): {base:5.2f} s "
          f"({base_cpu:.2f} s CPU)")
    ok = True
    for name, _, _ in runs[1:]:
        wall, cpu = statistics.median(walls[name]), statistics.median(cpus[name])
        ok &= wall / base <= CONFIG_GOAL
        print(f"capibara-exp {name:<32} {wall:5.2f} s  {wall / base:4.1f}x the baseline "
              f"(goal <= {CONFIG_GOAL:.0f}x); CPU {cpu:.2f} s, {cpu / base_cpu:4.1f}x")
    return ok


def _wall(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of cmd."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode not in (0, 2) or (out.returncode == 2) != ("model.emb_dm=64" in cmd):
        sys.exit(f"{' '.join(cmd)}: exit {out.returncode} (not what it times):\n"
                 f"{out.stderr[-2000:]}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-bytecode", action="store_true",
                        help="config commands under the environment's PYTHONDONTWRITEBYTECODE")
    parser.add_argument("--config-only", action="store_true",
                        help="only --help, --cfg job and a mistake against `import hydra`")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="capibara-config-") as tmp:
        config_ok = config_paths(max(args.repeats, 5), Path(tmp), not args.no_bytecode)
    print(f"{'PASS' if config_ok else 'FAIL'}: config commands within "
          f"{CONFIG_GOAL:.0f}x `import hydra`")
    if args.config_only:
        return
    with tempfile.TemporaryDirectory(prefix="capibara-startup-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache")}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        data = [f"data_dir={root / 'data'}"]
        first = timed([*COMMAND, *data], env, root)
        again = [timed([*COMMAND, *data], env, root) for _ in range(args.repeats)]
        second, cpu = statistics.median(again), statistics.median(CPU_S[1:])
        t5x = t5x_wall(root, env, args.repeats)
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} on {os.cpu_count()} cores (wall times grow with it)")
    print(f"capibara-exp debug=fast, first run (empty caches): {first:6.1f} s "
          f"({CPU_S[0]:.1f} s CPU)")
    print(f"capibara-exp debug=fast, run again (median of {args.repeats}): {second:6.1f} s "
          f"({', '.join(f'{w:.1f}' for w in again)}; {cpu:.1f} s CPU)")
    print(f"  again / first: {second / first:.2f}x")
    if t5x is not None:
        print(f"real T5X on the same config.gin (median of {args.repeats}): {t5x:6.1f} s")
        print(f"  capibara-exp again / T5X: {second / t5x:.2f}x")
    else:
        print("real T5X: not installed here (see /work/shared/third_party/README.md)")
    verdict = "PASS" if second <= GOAL_S else "FAIL"
    print(f"{verdict}: a repeated debug=fast run takes {second:.1f} s (goal <= {GOAL_S:.0f} s)")


if __name__ == "__main__":
    main()
