"""What ties the plugin to vLLM's server and engine: the configuration hook and the
server-wide defaults, request validation, the HTTP front end, metrics, the vLLM
version window (compat) and the list of every vLLM name the plugin relies on."""
