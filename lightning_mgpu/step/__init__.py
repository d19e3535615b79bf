"""One data-parallel step of a LightningModule, shared by ``mgpu_dp`` and the doctor.

``replicas`` runs the step in every replica and then ``*_step_end`` (``hooks``) or the default loss; ``replica_log``
turns the replicas' ``self.log`` calls into one; ``health`` warns once about what silently spoils training.
"""
