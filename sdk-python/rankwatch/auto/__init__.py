"""The agent without code changes: `rankwatch run -- COMMAND` (a `sitecustomize` in every
Python process COMMAND starts), `rankwatch attach RUN` / `detach RUN` (a dormant run switched
through the collector) and `rankwatch attach --pid PID` (injected into a running job).

- `imports`: run a function once a module is imported, without importing it.
- `boot/sitecustomize.py`: what `rankwatch run` puts first on PYTHONPATH.
- `launch`: `rankwatch run`'s environment.
- `agent`: the per-process agent: step counting, model discovery, loss capture, probes on/off.
- `find`: what the agent finds in a live process (the model an optimizer trains, a framework's
  step count, the loss scaler).
- `inject`: `attach/detach --pid`: finding the ranks, gdb or `sys.remote_exec`.

See docs/attach.md.
"""
