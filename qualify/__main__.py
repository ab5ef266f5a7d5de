"""`python -m qualify ...`: the `qualify` command, for an environment whose scripts directory is not on PATH (a
CUDA host's own Python, a site installed with `pip --target`)."""

from qualify.cli.entry import main

main()
