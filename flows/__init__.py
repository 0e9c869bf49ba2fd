"""The `vlm-caption` flow, its parameters, the CLI and the demo.

Prefect reads its settings when it is first imported, so the defaults this package needs are
set here, before any module of it imports Prefect. A user's own value always wins.
"""

import os

# Prefect gives its embedded (ephemeral) API server 20 s to start. A fresh database's
# migrations on a busy 2-core machine take longer, and a new user's first run must not fail on it.
EMBEDDED_SERVER_STARTUP_TIMEOUT_S = "600"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", EMBEDDED_SERVER_STARTUP_TIMEOUT_S)
# The embedded server's SQLite waits 10 s for a lock by default; a busy machine needs longer.
os.environ.setdefault("PREFECT_SERVER_DATABASE_TIMEOUT", "60")
# Prefect's embedded SQLite API reports "database is locked" while analytics run beside it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
