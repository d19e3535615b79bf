"""The command line's name and exit codes: one home for what the commands return and the doctor's report names."""

PROG = "lightning-mgpu"
EXIT_OK, EXIT_FOUND_ERRORS, EXIT_USAGE = 0, 1, 2
"""The exit codes of every command: success, error findings (``doctor``), a configuration that cannot start."""
