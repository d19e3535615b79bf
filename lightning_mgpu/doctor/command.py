"""The command's name and exit codes, which the command line returns and the report's last line prints.

They live here, not in ``cli.py``, so that ``format`` can print them without importing the command line that
imports it.
"""

PROG = "lightning-mgpu"
EXIT_OK, EXIT_FOUND_ERRORS, EXIT_USAGE = 0, 1, 2
