"""Trainer adapters, each behind its own extra and imported only on use.

* :mod:`odb_torch.integrations.hf`: ``ODBTrainer``, a ``transformers.Trainer`` subclass (``[hf]``);
* :mod:`odb_torch.integrations.trl`: ``ODBSFTTrainer``, subclassing ``ODBTrainer`` and TRL's ``SFTTrainer`` (``[trl]``);
* :mod:`odb_torch.integrations.accelerate`: helpers for a custom Accelerate loop (``[accelerate]``);
* :mod:`odb_torch.integrations.lightning`: ``ODBLightningCallback`` (``[lightning]``).
"""
