"""Peak proportional set size of every Python process started with this folder on ``PYTHONPATH`` and
``DSV41_PSS_DIR`` set (tests/test_lora_released_launch.py puts it under a printed ``accelerate launch``).

A thread samples ``/proc/self/smaps_rollup`` every 10 ms. PSS counts each shared page (the page cache of a
memory-mapped file, shared libraries) divided among the processes that map it. The baseline is the first sample
taken once the ``__main__`` script has defined ``main`` (its imports done); the peak is the largest sample from then
to exit, ``loaded`` the largest until ``training.fsdp.load_sharded_weights`` returned. Each process writes
``pss_<pid>.json`` at exit: its script, baseline, loaded and peak, in bytes.
"""

import os

if os.environ.get("DSV41_PSS_DIR"):
    import atexit
    import json
    import sys
    import threading

    _state = {"baseline": None, "peak": 0, "loaded": None}

    class _MarkLoaded:
        """Import hook: once ``modeling_dsv41.training.fsdp`` has run, its ``load_sharded_weights`` notes the peak so
        far when it returns (before any ``from ... import`` binds the name)."""

        def find_spec(self, name, path=None, target=None):
            if name != "modeling_dsv41.training.fsdp":
                return None
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                load = module.load_sharded_weights

                def load_sharded_weights(*args, **kwargs):
                    load(*args, **kwargs)
                    _state["loaded"] = max(_state["peak"], _pss())

                module.load_sharded_weights = load_sharded_weights

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _MarkLoaded())

    def _pss() -> int:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no Pss line in /proc/self/smaps_rollup")

    def _sample(stop: threading.Event) -> None:
        while not stop.wait(0.01):
            main = sys.modules.get("__main__")
            if _state["baseline"] is None:
                if main is not None and callable(getattr(main, "main", None)):
                    _state["baseline"] = _state["peak"] = _pss()
                continue
            _state["peak"] = max(_state["peak"], _pss())

    _stop = threading.Event()
    threading.Thread(target=_sample, args=(_stop,), daemon=True).start()

    @atexit.register
    def _write() -> None:
        _stop.set()
        if _state["baseline"] is None:
            return
        _state["peak"] = max(_state["peak"], _pss())
        script = os.path.basename(sys.argv[0]) if sys.argv else ""
        path = os.path.join(os.environ["DSV41_PSS_DIR"], f"pss_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"script": script, **_state}, f)
