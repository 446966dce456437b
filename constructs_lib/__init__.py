"""Small typed CDK constructs of the S4 KV deployment (composed by stacks/)."""
