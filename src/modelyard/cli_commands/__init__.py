"""The admin subcommands of `modelyard` (tenants, keys, deploy, endpoints, usage, files, batches,
chat, login), each talking to a running platform over its HTTP API."""
