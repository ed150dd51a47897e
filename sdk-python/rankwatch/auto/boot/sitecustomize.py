"""rankwatch's `sitecustomize`: `rankwatch run` puts this directory first on PYTHONPATH, so
every Python process the launched command starts (torchrun's agent, each rank, data-loader
workers) runs it at start-up, as `opentelemetry-instrument` and `ddtrace-run` do.

It first runs the `sitecustomize` this one hides, if any, then, in a process where
RANKWATCH_AUTO is set, arranges for the agent to start once the process imports torch. It
never imports torch itself and never raises: a process that cannot load rankwatch says so once
on stderr and runs as it would have.
"""

import os
import sys


def _chain() -> None:
    """Runs the next `sitecustomize` on the path, the one this file shadows."""
    import importlib

    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - the user's sitecustomize failed: as Python reports it, and go on
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}", file=sys.stderr)
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _start() -> None:
    if not os.environ.get("RANKWATCH_AUTO"):
        return
    sdk = os.environ.get("RANKWATCH_SDK_PATH")
    if sdk and sdk not in sys.path:
        sys.path.append(sdk)  # last: rankwatch itself, not a new copy of anything else
    try:
        # By file, not `import rankwatch...`: the package imports torch, which a launcher or a
        # tokenizer script must not pay for.
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "imports.py")
        spec = importlib.util.spec_from_file_location("_rankwatch_when_imported", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        when_imported = module.when_imported
    except Exception as e:  # noqa: BLE001
        print(f"rankwatch: cannot load the agent in {sys.executable} ({type(e).__name__}: {e}); this process runs unwatched", file=sys.stderr)
        return

    def on_torch(_module: object) -> None:
        try:
            from rankwatch.auto.agent import Settings, start

            start(Settings.from_env())
        except Exception as e:  # noqa: BLE001
            print(f"rankwatch: the agent did not start ({type(e).__name__}: {e}); this process runs unwatched", file=sys.stderr)

    when_imported("torch", on_torch)


_chain()
_start()
