"""openmla's application tooling: the ``openmla`` command (demo, bench, check, accuracy, build,
compile-report, generate, models), the Triton compile report (``compile_report``) and the random
cases the test-suite and ``openmla check`` share.

It sits above the library: it imports ``openmla``, and no module of ``openmla`` imports it
(tests/test_layering.py holds that). The command needs the ``tools`` extra (``rich`` for its
tables and progress, ``matplotlib`` for the plots): ``pip install -e ".[tools]"``.
"""
