"""Put on PYTHONPATH by `rankfs run`: installs the (dormant) rankfs hook in every Python process of
the engine, workers included since they inherit the environment, then hands over to any
sitecustomize this one shadows."""

import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    try:
        import rankfs.loader.startup
    except ImportError:  # the engine's Python is not rankfs's: find rankfs where this file lies
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(_here))))
        import rankfs.loader.startup
    rankfs.loader.startup.install()
except Exception as exc:  # never stop the engine from starting: it then loads the stock way
    print(f"rankfs hook: not active: {exc}", file=sys.stderr)

for _entry in sys.path:
    if os.path.abspath(_entry or ".") == _here:
        continue
    _candidate = os.path.join(_entry, "sitecustomize.py")
    if os.path.isfile(_candidate):
        _spec = importlib.util.spec_from_file_location("_rankfs_shadowed_sitecustomize", _candidate)
        _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
