"""The `vlm-caption` flow, its parameters, the CLI and the demo.

Importing it (or any module of this package) changes no environment variable: the Prefect
settings a run needs for Prefect's embedded server are set by the CLI as `run` and `demo` begin
(`embedded_server_defaults` in tasks/prefect_api.py).
"""
