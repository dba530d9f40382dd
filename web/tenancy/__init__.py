"""Tenancy at the gateway: who calls (principal, SQL tenancy), admission and the auth guards."""
