"""Sizing: EC2 GPU catalog, model shapes and KV capacity. Standard library only (the CDK app uses it)."""
