"""`python -m capibara_exp.cli ...` is `capibara-exp ...` (the sweeper's workers use it)."""

from capibara_exp.cli.main import main

main()
