"""The Prefect glue: flows, UI artifacts, serving, log routing, signal handling, Prefect workarounds.

Every module here imports Prefect (some lazily), so the package sets the project's Prefect defaults first
(flows/orchestration/prefect_env.py): this call is the one thing importing the package does.
"""

from flows.orchestration.prefect_env import use_project_defaults

use_project_defaults()
