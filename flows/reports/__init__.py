"""Reports read from the store, without Prefect."""
