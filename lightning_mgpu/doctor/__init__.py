"""The doctor: find a LightningModule's multi-GPU traps on a laptop, before GPU hours are spent on them.

It runs one training step on a probe batch twice, on one device and split across virtual CPU replicas exactly as
``mgpu_dp`` splits it, and compares the outputs, the loss and every gradient. A difference means the step does
batch-wise work that each replica can only do on its own chunk. The structural checks of ``model_checks`` and
findings about unused parameters and BatchNorm complete the report. ``format`` turns the report into tables and
``cli.py`` prints them; nothing here prints.

Data flows one way: ``inputs`` → ``runs`` → ``compare`` → ``findings`` → ``report`` → ``format``; ``checkup`` calls
the steps in that order. No module imports a later one, except the data classes of ``report`` that the steps fill.
"""

from lightning_mgpu.doctor.checkup import diagnose, run_doctor
from lightning_mgpu.doctor.format import format_report
from lightning_mgpu.doctor.inputs import DoctorError, instantiate, load_class, probe_batch, read_config
from lightning_mgpu.doctor.report import TARGETS, Comparison, DoctorReport, Target

__all__ = [
    "TARGETS",
    "Comparison",
    "DoctorError",
    "DoctorReport",
    "Target",
    "diagnose",
    "format_report",
    "instantiate",
    "load_class",
    "probe_batch",
    "read_config",
    "run_doctor",
]
