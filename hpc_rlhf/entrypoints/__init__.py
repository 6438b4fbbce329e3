"""The command line, one module per group of subcommands; `hpc_rlhf/cli.py` assembles them.

Only argparse and the printing of results live here: each subcommand calls the command table
(`hpc_rlhf/commands.py`) or a plain function of the library.  Library code never imports this package.
"""
