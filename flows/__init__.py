"""The `vlm-caption` flow, its parameters, the CLI and the demo. Importing it changes no environment
variable: the CLI sets Prefect's embedded-server settings as `run` and `demo` begin
(`embedded_server_defaults` in tasks/prefect_api.py)."""
