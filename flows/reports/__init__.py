"""What the store holds, read without Prefect (an import-linter contract keeps it so): store status, a sweep's
definition and comparison, two configs side by side, a run's summary."""
