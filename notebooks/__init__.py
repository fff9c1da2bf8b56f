"""The float16 study's notebooks and scripts.

A package only so that the tests import the study as ``notebooks.study``
from the repository root, without editing ``sys.path``.
"""
