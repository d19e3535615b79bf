"""Benchmarks of lightning_mgpu against raw PyTorch and stock Lightning: ``python -m benchmarks.run --quick``."""
