"""``python -m lightning_mgpu <command>``: the ``lightning-mgpu`` console script, for environments without it."""

from lightning_mgpu.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
