"""ODB's PyTorch adapter: the production DataLoader over :mod:`odb_core`.

The loader itself lands with the odb_torch issue; this package already hosts the
``odb`` command line (``odb_torch.cli``), whose core-only commands never import torch.
"""
