"""The doctor: find a LightningModule's multi-GPU traps on a laptop, before GPU hours are spent on them.

It runs one training step on a probe batch twice, on one device and split across virtual CPU replicas exactly as
``mgpu_dp`` splits it, and compares them stage by stage: what ``training_step_end`` receives (``training_step``'s
output, gathered from the replicas when split), the hook's result, every gradient and every buffer after the step.
The first stage that differs names the likely cause: batch-wise work in the step, state the replicas did not hand
back to the hook, a backward that depends on the chunk, buffers updated per replica. When something differs, one
more run with another seed shows randomness, and one replica running the whole batch shows what batch-wise work
cannot explain. For ``mgpu_ddp``, ``ranks`` runs each ``*_step_end`` hook on each rank's rows and on every rank's, as
``MGPUDDPStrategy(gather_step_end=True)`` gives them. The structural model checks of ``lightning_mgpu.checks`` and
findings about unused parameters and BatchNorm complete the report. ``format`` turns the report into tables and
``cli/doctor.py`` prints them; nothing here prints.

Data flows one way: ``inputs`` → ``runs`` → ``ranks`` → ``compare`` → ``findings`` → ``report`` → ``format``;
``checkup`` calls the steps in that order. No module imports a later one, except the data classes of ``report`` that
the steps fill.
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
