"""pagoda.kernels

Imported as a top-level `kernels` (the checkout's root on sys.path: `python -m` from it, pytest's pythonpath), this
folder would shadow Hugging Face's `kernels` package, which transformers imports when it is installed (a dependency
of transformers >= 5.25): the import is handed to the installed package instead, or fails as if the folder were not
there.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.loader is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
