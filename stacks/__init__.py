"""CDK stacks of the S4 KV deployment: they only compose constructs_lib/."""
