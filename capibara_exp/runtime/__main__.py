"""`python -m capibara_exp.runtime CONFIG_GIN [--distributed=auto]`: train a rendered
config.gin with the local engine, as each worker of a multi-host launch does."""

from __future__ import annotations

import argparse
import logging
import sys

from capibara_exp.base import environment
from capibara_exp.base.errors import ConfigError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m capibara_exp.runtime",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("config_gin", help="a config.gin rendered for engine=local")
    parser.add_argument("--distributed", choices=("single", "auto"), default="single",
                        help="auto: join the slice's processes (jax.distributed.initialize())")
    args = parser.parse_args(argv)
    environment.prepare()
    if args.distributed == "auto":
        import jax

        jax.distributed.initialize()
    from capibara_exp.runtime import gin_utils

    try:
        gin_utils.run_train(args.config_gin)
    except ConfigError as err:
        print(f"capibara_exp.runtime: configuration error: {err}", file=sys.stderr, flush=True)
        # the one line is the outcome: a library's thread still winding down as the process
        # exits (orbax's cleanup of temporary checkpoint paths, its executor already shut)
        # would log a traceback after it
        logging.disable(logging.CRITICAL)
        sys.exit(2)


if __name__ == "__main__":
    main()
