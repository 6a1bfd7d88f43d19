"""Thin Dagster assets and asset checks over ops/ and checks/."""
