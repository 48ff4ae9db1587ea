"""The ``odb`` command and everything it runs; nothing here runs in training.

* :mod:`odb_tools.cli`: the ``odb`` command line (``simulate``, ``check``, ``demo``,
  ``bench batching``, ``profile``, ``tune``); ``python -m odb_tools`` runs it too.
* :mod:`odb_tools.demo`: ``odb demo``, a CPU DDP fine-tune comparing Standard, Sorted and
  ODB batching on real chat data (and the small synthetic dataset and model of the
  adapter guides).
* :mod:`odb_tools.bench_batching`, :mod:`odb_tools.baselines`,
  :mod:`odb_tools.reference_alignment`: ``odb bench batching``, the batchers ODB is
  compared with and the paper authors' package driven live on Gloo ranks.
* :mod:`odb_tools.profile`: ``odb profile``.
* :mod:`odb_tools.tune`: ``odb tune``, the largest token budget whose worst batch shapes fit a
  memory limit.

The layering (``tests/test_import_direction.py``): :mod:`odb_core` <- :mod:`odb_torch`
<- :mod:`odb_tools`; :mod:`model_checks` -> :mod:`odb_core`. This package may import all of
them; none of them imports this package.
"""
