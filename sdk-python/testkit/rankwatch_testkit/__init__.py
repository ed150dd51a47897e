"""rankwatch-testkit: what rankwatch's tests, examples, benchmarks and demo train on.

`models` is a small nanoGPT (the layout discovery must find as nanoGPT users have it) and
`faults` injects what goes wrong in real data-parallel jobs, on purpose. Neither belongs to
what a user installs with `pip install rankwatch`, so they live in this separate package,
installed editable into the development environment by `sdk-python/tests/requirements.txt`.
"""
