"""Model checking of the ODB protocol: TLC on spec/, mutants, conformance with odb_core.

Runs from a checkout of the repository (it reads ``spec/``); the entry point is
``odb check`` (:func:`model_checks.report.check`).
"""
