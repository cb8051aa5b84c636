"""Import shim: TE's test files import ``transformer_engine``; its names resolve to transformer_fa.

Importing this package installs the finder (``_shim.py``, tables in ``_mapping.py``), which then
serves ``transformer_engine.*`` and ``transformer_engine_torch``. Put only on the path of a run
of TE's tests (tools/te_suite/run.py does), never next to the real TransformerEngine.
"""
from ._shim import install

install()
