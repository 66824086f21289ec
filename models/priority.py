"""vLLM request priorities of the two traffic classes, shared by every enforcing component.

vLLM's priority policy serves lower values first. The gate, `borrowd gate`, the proxy, the
simulator and the engine plugin tag and recognise batch work by `BATCH_PRIORITY`; the plugin
treats any priority at or past it as batch.
"""

INTERACTIVE_PRIORITY = 0
BATCH_PRIORITY = 10
