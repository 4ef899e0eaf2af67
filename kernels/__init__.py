"""pagoda.kernels

Imported as a top-level `kernels` (the checkout's root on sys.path: `python -m` from it, pytest's pythonpath), this
folder would shadow Hugging Face's `kernels` package, which transformers imports when it is installed (a dependency
of transformers >= 5.25): the import is handed to the installed package instead. Where none is installed, the folder
stays an empty stand-in that reads as "not installed": no file, no version, no submodules, no names (`from kernels
import X` raises ImportError). transformers <= 5.24 finds the folder, finds no distribution metadata, imports it
and takes a module without __file__ for a namespace-package shadow, not an install; an import error raised here
instead broke `import transformers.models...` there.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
    else:
        for _name in ("importlib", "os", "sys", "_checkout", "_elsewhere", "_spec"):
            del globals()[_name]
        __file__ = None  # type: ignore[assignment]
        __path__: list[str] = []

        def __getattr__(name: str) -> object:
            raise AttributeError(f"module 'kernels' has no attribute {name!r}: this is the pagoda checkout's kernels/ "
                                 f"folder; Hugging Face's kernels package is not installed")
