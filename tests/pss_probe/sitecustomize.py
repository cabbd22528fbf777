"""Peak proportional set size of every Python process started with this folder on ``PYTHONPATH`` and
``DSV41_PSS_DIR`` set (tests/test_lora_released_launch.py puts it under a printed ``accelerate launch``).

Once the baseline is taken, a thread samples ``/proc/self/smaps`` 50 ms after its last sample (a sample of a process
with torch loaded reads ~850 mappings: ~30 ms of CPU, most of it the kernel's; at 10 ms the samplers of 4 processes
took more than one of the 2 cores and doubled the launch's time). PSS counts each shared page (the page cache of a
memory-mapped file, such as the Engram tables) divided among the processes that map it. What is sampled is the PSS
of the process's data: every mapping but the code and read-only data of the interpreter and of shared libraries
(``.so`` files). Those pages are code, not data; the processes touch more of them as they run ops for the first
time, and their share in each process moves as the other processes map them, so counting them would make the rise
depend on when each process took its baseline (by up to 10 MiB on the 4-process launch). The baseline is the first
sample taken once the ``__main__`` script has defined ``main`` (its imports done); the peak is the largest sample
from then to exit, ``loaded`` the largest until ``training.fsdp.load_sharded_weights`` returned. Each process writes
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

    import re

    _CODE = re.compile(r"\.so(\.[\d.]+)?$")
    _EXECUTABLE = os.path.realpath(sys.executable)

    def _pss() -> int:
        """PSS of the process's data (bytes): every mapping's but the interpreter's and the shared libraries'."""
        total, code = 0, False
        with open("/proc/self/smaps") as f:
            for line in f:
                first = line.split(maxsplit=6)
                if first[0].endswith(":"):
                    if first[0] == "Pss:" and not code:
                        total += int(first[1]) * 1024
                    continue
                path = first[5].strip() if len(first) > 5 else ""
                code = bool(_CODE.search(path)) or path == _EXECUTABLE
        return total

    def _sample(stop: threading.Event) -> None:
        # every 10 ms until the baseline (taken at once when the imports end), every 50 ms after it
        while not stop.wait(0.01 if _state["baseline"] is None else 0.05):
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
