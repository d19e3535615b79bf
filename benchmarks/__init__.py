"""Benchmarks for lightning_mgpu against raw PyTorch and stock Lightning: ``python -m benchmarks.run --quick``.

Every number this package writes is a ratio of variants measured side by side in one run, the median over repeats
that alternate the variants (A B C A B C ...), with the min and max beside it. See ``benchmarks/README.md``.
"""
