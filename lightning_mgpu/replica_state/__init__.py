"""What a replica's step changes, made exact: one rule for every channel through which replica threads share state.

A replica's step is one device's step on its chunk. A change every replica makes alike is applied once; a change
that combines exactly is combined as step outputs are gathered; anything else stops the step with
``ReplicaStateError`` before the module changes. ``guard`` routes what torch keeps per process (parameter storage,
the default generator) to each replica's own, ``process`` puts back the process-wide settings a step changed and
refuses the step, ``buffers`` settles each replica's copies of the module's buffers, ``metrics`` gives each replica
copies of the module's torchmetrics metrics and merges them back, and ``batchnorm`` normalises BatchNorm layers over
the whole batch. The plain containers a step changes are copied per replica by ``lightning_mgpu.engine.containers``,
which combines them with the rules that gather step outputs, beside them in the engine.
"""

from lightning_mgpu.replica_state.guard import ReplicaGuard, ReplicaStates

__all__ = ["ReplicaGuard", "ReplicaStates"]
